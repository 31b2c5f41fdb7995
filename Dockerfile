# GPU image for megatron-fp8: a CUDA PyTorch base plus this package and its optional extras.
# The base must provide torch >= 2.11 with CUDA and Triton (the FP8 kernels need sm_90 or newer).
# Not built in this repository's CI (the CI machines have no Docker engine).
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-devel
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1

WORKDIR /workspace/megatron-fp8
COPY pyproject.toml README.md pretrain_gpt.py ./
COPY megatron ./megatron
COPY tools ./tools
COPY scripts ./scripts
COPY tests ./tests

# The base image's torch is kept: the package does not pin torch.
RUN python -m pip install --no-cache-dir -e ".[all,test]" \
    && python -c "import megatron, torch; print('megatron-fp8 on torch', torch.__version__)"

ENTRYPOINT ["python", "pretrain_gpt.py"]
CMD ["--help"]
