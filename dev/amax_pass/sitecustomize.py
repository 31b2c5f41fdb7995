"""Put this folder first on PYTHONPATH to run with linear_ops.AMAX_IN_GRAPH off: compiled
tensorwise quantization runs its own amax pass instead of taking max|x| from the graph
(benchmarks/model_a_dp1.sh's `<recipe>_amaxpass` rows, an A/B of the producer-fused amax).
Python imports `sitecustomize` at start-up in every process, torchrun's workers included."""

from megatron.core.fp8.cuda import linear_ops

linear_ops.AMAX_IN_GRAPH = False
