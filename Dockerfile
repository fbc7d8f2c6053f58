# zero3d on NVIDIA's PyTorch image: the image's CUDA, NCCL, apex and torch; the project's pinned deps on top.
#
# nvcr.io/nvidia/pytorch:25.04-py3 ships Ubuntu 24.04, Python 3.12, CUDA 12.9 and PyTorch 2.7.0a0 (NVIDIA's
# build of 2.7) with apex. torch is never installed from PyPI here: a wheel would replace NVIDIA's build.
#   docker build -t zero3d:latest .
#   enroot import -o zero3d.sqsh dockerd://zero3d:latest      # for pyxis: slurm/README.md
FROM nvcr.io/nvidia/pytorch:25.04-py3

WORKDIR /workspace/zero3d
COPY pyproject.toml README.md ./
COPY zero3d ./zero3d
COPY optim ./optim
COPY analysis ./analysis
COPY model_shape ./model_shape
COPY megatron_patches ./megatron_patches
COPY pretrain ./pretrain
COPY configs ./configs
COPY slurm ./slurm
COPY data ./data

# The image's /etc/pip/constraint.txt pins every package it ships and can clash with the pins below,
# so it is swapped for one that pins only torch, to the build already in the image.
# The list must match pyproject.toml's [project] dependencies and its `hf` extra (tests/unit/test_paper_configs.py checks).
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/torch-constraint.txt \
 && PIP_CONSTRAINT=/tmp/torch-constraint.txt pip install --no-cache-dir \
        "megatron-core==0.16.1" \
        "sentencepiece==0.2.3" \
        "tokenizers==0.23.3" \
        "tiktoken==0.14.0" \
        "pyarrow==26.0.1" \
        "numpy>=1.26,<3" \
        "wandb==0.31.0" \
        "tensorboard==2.21.0" \
        "psutil==7.2.2" \
        "tqdm==4.70.1" \
        "matplotlib==3.11.2" \
        "safetensors==0.8.0" \
        "zstandard==0.25.0" \
        "transformers==5.24.0" \
 && pip install --no-cache-dir --no-deps -e . \
 && python -c "import torch, megatron.core, zero3d, optim, pretrain; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)"

# W&B writes offline into each run dir unless WANDB_API_KEY / WANDB_MODE say otherwise.
ENV PYTHONUNBUFFERED=1 \
    ZERO3D_PYTHON=python
# `docker run IMAGE --config configs/tiny.toml`; pyxis (srun --container-image) runs its own command.
ENTRYPOINT ["python", "-m", "pretrain"]
CMD ["--help"]
