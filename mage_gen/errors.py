"""The errors a user can cause. The CLI prints any of them as one line and exits with code 2."""


class MageError(Exception):
    """A problem the user can fix; the message says what is wrong and what to do."""


class ConfigError(MageError):
    """A shape or parameter set that an op cannot generate; the message starts with the rule's name."""


class CompileError(MageError):
    """NVRTC rejected generated source; the message carries NVRTC's log."""


class NoGpuError(MageError):
    """The step needs a GPU and this machine has no usable CUDA driver."""


class GpuError(MageError):
    """A CUDA driver call failed; the message names the call and the CUresult."""


class StoreError(MageError):
    """tuned/ holds something that cannot be used (corrupt, stale, or missing)."""


class LaunchError(MageError, ValueError):
    """Arguments a kernel cannot be launched with (shape, dtype, alignment, size); the message names the argument."""
