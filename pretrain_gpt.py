"""Pretrain a GPT with megatron-fp8. Launch with python, torchrun or Slurm; see --help."""

from megatron.training.training import pretrain

if __name__ == "__main__":
    pretrain()
