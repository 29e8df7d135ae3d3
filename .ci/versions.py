"""Print the versions a CI job ran with, in the form the README's "tested with" line quotes."""

from importlib import metadata

PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "peft",
    "sentence-transformers",
    "accelerate",
    "safetensors",
    "numpy",
    "tqdm",
    "matplotlib",
    "onnxruntime",
)
found = []
for name in PACKAGES:
    try:
        found.append(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        found.append(f"{name} (absent)")
print("versions: " + ", ".join(found))
