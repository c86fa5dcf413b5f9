from setuptools import find_packages, setup

SERVE = ["fastapi>=0.110", "uvicorn>=0.29", "python-multipart", "prometheus-client", "sqlalchemy>=2", "alembic"]
# `h3trt serve --ray`: Ray Serve runs the ingress and the worker replicas (the autoscaling hooks are 2.60's), the shared
# job store is PostgreSQL (psycopg 3, SQLAlchemy's postgresql+psycopg), clips on object storage through fsspec (s3fs).
FLEET = ["ray[serve]==2.60.*", "psycopg[binary]>=3.1", "s3fs"]

setup(
    name="h3trt",
    version="0.1.0",
    description="Compiled inference engine for MiniMax-H3, the joint video+audio diffusion transformer",
    packages=find_packages(include=["h3trt", "h3trt.*"]),
    # h3trt serve's page and the job store's Alembic migrations travel with the package.
    package_data={"h3trt.server": ["page.html", "migrations/*.py", "migrations/*.mako", "migrations/versions/*.py"]},
    python_requires=">=3.10",
    install_requires=[
        # The GPU image runs torch 2.11; CI and developer machines run 2.13 (CPU wheel). Both are supported.
        "torch>=2.11,<=2.14.1",
        "numpy",
        "safetensors",
        # The VAE modules are diffusers' own (pinned: our decode plan reproduces this version's arithmetic); the
        # same version is the correctness oracle of every parity test.
        "diffusers==0.42.1",
        "accelerate",  # device_map loading of the 32B text encoder; diffusers' fp32-island loading needs it too
        # Qwen3-VL (transformers 5 APIs). Bounded above: h3trt/models/qwen_video.py reproduces this range's
        # Qwen3VLVideoProcessor bit for bit, and tests/data/qwen_video_reference.npz holds its outputs; a release is
        # admitted once `scripts/make_qwen_video_fixtures.py --check` shows it makes them still (5.17.0, 5.24.0 and
        # 5.25.0 do). tests/house/test_dependencies.py checks the bound and the installed version.
        "transformers>=5.17,<5.26",
        "av>=14",  # H.264 + AAC muxing with PyAV's bundled FFmpeg
        "Pillow",
        "tqdm",
        "matplotlib",  # h3trt run --requests draws OUT/timeline.png
        "filelock",  # concurrent first runs build the tiny model's cache once
        "cryptography",  # Ed25519 bundle signatures (h3trt build --sign, run/verify --trust)
    ],
    extras_require={
        # `h3trt serve`: the HTTP API (FastAPI on uvicorn; multipart uploads), Prometheus metrics, the job store
        # (SQLAlchemy Core over SQLite by default, its schema versioned by Alembic).
        "serve": SERVE,
        "fleet": [*SERVE, *FLEET],
        "test": [
            *SERVE, *FLEET,
            # The fleet's tests: a local S3-compatible server (moto's server mode) stands in for object storage.
            "moto[server]>=5",
            # The server's tests: the official openai SDK as the client, schemathesis over the OpenAPI schema, and a
            # real browser (Debian's chromium, driven by playwright) for the page. openai bounded to the major the suite
            # runs on (3.63.0): the tests drive the server through its `client.videos`, which 3.x marks deprecated (the
            # Sora API's end) and a later major may drop; tests/house/test_dependencies.py checks the bound.
            "openai>=3,<4", "httpx", "schemathesis>=4", "playwright",
            "pytest",
            "packaging",  # tests/house/test_dependencies.py reads setup.py's version ranges with it
            "pytest-xdist",  # the README's test command runs two workers (-n 2 --dist loadfile), one per CI core
            # The TensorRT backend's CPU tests (tests/build/test_tensorrt.py): ONNX export and onnxruntime parity,
            # ModelOpt FP8/NVFP4 Q/DQ (with the pieces of its [onnx] extra the NVFP4 exporter imports; the extra itself
            # pulls CUDA wheels), and TensorRT-RTX, which builds plans without a GPU. About 150 MB, under a minute to
            # install.
            "onnx>=1.21", "onnxruntime>=1.20", "tensorrt-rtx==1.7.1.116", "nvidia-modelopt==0.47.0",
            "onnx-graphsurgeon>=0.6.1", "onnxscript", "onnxslim", "lief",
            # The onnxruntime-vs-eager parity checks run through polygraphy's Comparator, as the plans' checks against
            # onnxruntime will on a GPU (tensorrt_notes.md section 5); `h3trt inspect` shows a tensorrt bundle's plans
            # through it where it is installed (h3trt/engines/tensorrt_inspect.py, same pin). Pure Python, no
            # dependencies, 0.5 MB.
            "polygraphy==0.53.6",
            # diffusers loads LoRAs through peft: the oracle of the LoRA parity tests (tests/adapters/test_lora.py).
            # Bounded above (tested on 0.21.2): a peft release that changes how diffusers 0.42.1 maps a LoRA changes the
            # oracle.
            "peft<0.22",
            # The fused SubBlock router's kernels (h3trt/models/sparse/router_triton.py) run on the CPU under Triton's
            # interpreter in tests/models/test_sparse_router.py. The GPU image's release (3.6.0, with torch 2.11); no
            # dependencies; a 188 MB wheel, about 20 s to install.
            "triton==3.6.0",
        ],
        # `h3trt build --precision fp8|nvfp4`: calibration runs through NVIDIA ModelOpt, this release and no other
        # (h3trt/calibration/recipe.py MODELOPT_VERSION refuses another). Pure Python; its CUDA extensions are never
        # built.
        "calibration": ["nvidia-modelopt==0.47.0"],
        # `h3trt build --fp8-attention` on a GPU, and serving its bundles: cuDNN's FP8 flash attention through the
        # cuDNN graph API (1.16.0: 2 MB, no dependencies; it uses the cuDNN that torch already loaded).
        "fp8-attention": ["nvidia-cudnn-frontend==1.16.0"],
        # `h3trt build --attention fa3` (or auto picking it) on a Hopper GPU, and serving such bundles:
        # FlashAttention-3's forward, bf16 and FP8 (27.6 MB abi3 wheel, sm_90a cubins, torch stable ABI, CUDA 13
        # runtime; provenance in README, "FlashAttention-3").
        "fa3": ["fa3-fwd==0.0.3"],
        # The fa4 block-sparse attention kernel (h3trt/models/sparse/kernels.py) on sm_90 and newer: FlashAttention-4's
        # CuTe DSL forward, the exact set that ran on the H200 image (issue 36). The -libs-cu13 CuTe runtime, not
        # -libs-cu12 (torch 2.11 on the GPU image is cu130). Kernels JIT-compile at load (warm_sparse_kernel). Not in
        # the test extra: nothing of it runs on a CPU.
        "fa4": ["flash-attn-4==4.0.0b36", "nvidia-cutlass-dsl==4.8.1", "nvidia-cutlass-dsl-libs-base==4.8.1",
                "nvidia-cutlass-dsl-libs-core==4.8.1", "nvidia-cutlass-dsl-libs-cu13==4.8.1", "quack-kernels==0.6.5",
                "apache-tvm-ffi==0.1.15.post2", "torch-c-dlpack-ext==0.1.5", "einops"],
    },
    entry_points={"console_scripts": ["h3trt=h3trt.cli:main"]},
)
