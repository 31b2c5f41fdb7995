"""Put this folder first on PYTHONPATH to run with the FP8 debug setting `amax_in_graph` off
(`megatron.core.fp8.debug`): compiled tensorwise quantization runs its own amax pass instead
of taking max|x| from the graph (benchmarks/model_a_dp1.sh's `<recipe>_amaxpass` rows, an A/B
of the producer-fused amax). Python imports `sitecustomize` at start-up in every process,
torchrun's workers included."""

from megatron.core.fp8.debug import set_debug_config

set_debug_config(amax_in_graph=False)
