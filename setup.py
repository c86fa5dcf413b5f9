from setuptools import find_packages, setup

setup(
    name="h3trt",
    version="0.1.0",
    description="Compiled inference engine for MiniMax-H3, the joint video+audio diffusion transformer",
    packages=find_packages(include=["h3trt", "h3trt.*"]),
    python_requires=">=3.10",
    install_requires=[
        # The GPU image runs torch 2.11; CI and developer machines run 2.13 (CPU wheel). Both are supported.
        "torch>=2.11,<=2.14.1",
        "numpy",
        "safetensors",
    ],
    extras_require={
        # diffusers 0.42.1 is the correctness oracle: every parity test compares against it.
        "test": ["pytest", "diffusers==0.42.1"],
    },
    entry_points={"console_scripts": ["h3trt=h3trt.cli:main"]},
)
