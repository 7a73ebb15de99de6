"""mage-gen: generate, check and tune NVIDIA GPU kernels written with inline PTX."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mage-gen")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
