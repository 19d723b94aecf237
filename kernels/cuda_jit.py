"""CUDA C++ kernels compiled at run time: NVRTC (the ``nvidia-cuda-nvrtc`` library that CUDA
builds of torch ship), else ``nvcc`` when it is on the PATH; loaded and launched through the CUDA
driver API (``libcuda``), on torch's current stream, so launches are captured by CUDA graphs.

No build step: the first use compiles and caches the cubin under ``$MINITE_CACHE_DIR`` (default
``~/.cache/minite``), keyed by the source, the architecture and the compiler options. Nothing
here is needed on the CPU path; callers fall back to the Triton kernels when :func:`load` raises
:class:`CudaJitError` (no compiler, driver error).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
import site
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

#: ``0``: the Triton kernels serve every shape; ``1``: the CUDA C++ kernels serve every shape they
#: cover; unset (``auto``): they serve the shapes where they measured faster (each kernel says).
CUDA_KERNELS_ENV = "MINITE_CUDA_KERNELS"
_OPTIONS = ("--fmad=false", "-std=c++17")
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id and a 64-byte value union (8-byte aligned)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


def _cluster_attribute(attr: _LaunchAttribute, cluster_z: int) -> None:
    """``attr`` as a cluster dimension of ``cluster_z`` CTAs along the grid's z."""
    attr.id = _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value[0], attr.value[1], attr.value[2] = 1, 1, cluster_z


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` of ``cuLaunchKernelEx``."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


class CudaJitError(RuntimeError):
    """The CUDA C++ kernels cannot be compiled or loaded here (callers fall back to Triton)."""


def mode() -> str:
    """``"off"``, ``"on"`` or ``"auto"`` (the default), from ``MINITE_CUDA_KERNELS``."""
    value = os.environ.get(CUDA_KERNELS_ENV, "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    return "on" if value in ("1", "true", "yes", "on") else "auto"


def _cache_dir() -> Path:
    root = os.environ.get("MINITE_CACHE_DIR") or os.path.join(Path.home(), ".cache", "minite")
    return Path(root) / "cubin"


def _nvrtc() -> ctypes.CDLL | None:
    names = []
    for base in [*site.getsitepackages(), site.getusersitepackages(), *sys.path]:
        names += glob.glob(os.path.join(base, "nvidia", "**", "libnvrtc.so*"), recursive=True)
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    names += glob.glob(os.path.join(cuda_home, "lib64", "libnvrtc.so*"))
    names = [n for n in names if "builtins" not in n and "alt" not in os.path.basename(n)]
    for name in sorted(set(names), key=len) + ["libnvrtc.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _compile_nvrtc(lib: ctypes.CDLL, source: str, name: str, arch: str) -> bytes:
    prog = ctypes.c_void_p()
    check = _nvrtc_check(lib)
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None))
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in _OPTIONS)]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if status != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise CudaJitError(f"NVRTC could not compile {name}:\n{log.value.decode()}")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, cubin))
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_check(lib: ctypes.CDLL):
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(status: int) -> None:
        if status != 0:
            raise CudaJitError(f"NVRTC error {status}: {lib.nvrtcGetErrorString(status).decode()}")

    return check


def _compile_nvcc(source: str, name: str, arch: str) -> bytes:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise CudaJitError("neither NVRTC (nvidia-cuda-nvrtc) nor nvcc is available")
    virtual = arch.replace("sm_", "compute_")
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, name), os.path.join(tmp, "out.cubin")
        Path(src).write_text(source)
        cmd = [nvcc, f"-gencode=arch={virtual},code={arch}", "-cubin", "-O3", *_OPTIONS, "-o", out]
        done = subprocess.run([*cmd, src], capture_output=True, text=True)
        if done.returncode != 0:
            raise CudaJitError(f"nvcc could not compile {name}:\n{done.stderr}")
        return Path(out).read_bytes()


def compile_cubin(source: str, name: str, arch: str) -> bytes:
    """The cubin of ``source`` for ``arch`` (e.g. ``sm_90a``), from the cache or compiled now."""
    key = hashlib.sha256("\0".join([source, arch, *_OPTIONS]).encode()).hexdigest()[:24]
    path = _cache_dir() / f"{Path(name).stem}-{arch}-{key}.cubin"
    if path.exists():
        return path.read_bytes()
    lib = _nvrtc()
    cubin = _compile_nvrtc(lib, source, name, arch) if lib else _compile_nvcc(source, name, arch)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs a recompile next time
    return cubin


class _Driver:
    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaJitError(f"the CUDA driver library is not loadable: {exc}") from exc
        self.lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.lib.cuLaunchKernel.argtypes = [
            ctypes.c_void_p, *([ctypes.c_uint] * 6), ctypes.c_uint, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p,
        ]  # fmt: skip
        self.lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p] * 4
        self.lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.c_void_p] * 3

    def check(self, status: int, what: str) -> None:
        if status != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(status, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else "unknown"
            raise CudaJitError(f"CUDA driver: {what} failed ({status}: {text})")


_DRIVER: _Driver | None = None
_LOCK = threading.Lock()


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


class Kernel:
    """One ``extern "C"`` kernel of a loaded module; call :meth:`launch` with a ctypes argument
    structure (the kernel's single by-value parameter)."""

    def __init__(self, function: ctypes.c_void_p) -> None:
        self.function = function
        self.max_smem = 48 << 10

    def _allow_smem(self, smem: int) -> None:
        if smem > self.max_smem:
            drv = _driver()
            drv.check(
                drv.lib.cuFuncSetAttribute(
                    self.function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem
                ),
                "raising the kernel's shared-memory limit",
            )
            self.max_smem = smem

    def launch(
        self,
        grid: tuple[int, int, int],
        block: int,
        smem: int,
        args,
        device,
        pdl: bool = False,
        cluster_z: int = 1,
    ) -> None:
        """Launch on torch's current stream. ``pdl``: programmatic dependent launch, so the grid
        may start while the previous kernel on the stream still runs (the kernel must execute
        ``griddepcontrol.wait`` before it reads anything that kernel writes). ``cluster_z``:
        thread-block clusters of that many CTAs along the grid's z (a kernel compiled without
        cluster dimensions; at most 8, dividing ``grid[2]``)."""
        drv = _driver()
        self._allow_smem(smem)
        if device.index is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                return self.launch(grid, block, smem, args, device, pdl, cluster_z)
        stream = torch.cuda.current_stream(device).cuda_stream
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(args), ctypes.c_void_p))
        if not pdl and cluster_z == 1:
            status = drv.lib.cuLaunchKernel(
                self.function, grid[0], grid[1], grid[2], block, 1, 1, smem, stream, params, None
            )
            return drv.check(status, "kernel launch")
        attrs = (_LaunchAttribute * 2)()
        count = 0
        if pdl:
            attrs[count].id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attrs[count].value[0] = 1
            count += 1
        if cluster_z > 1:
            if not (cluster_z <= 8 and grid[2] % cluster_z == 0):
                raise ValueError(f"clusters of {cluster_z} CTAs along a grid z of {grid[2]}")
            _cluster_attribute(attrs[count], cluster_z)
            count += 1
        config = _LaunchConfig(
            (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(block, 1, 1), smem, stream,
            ctypes.cast(attrs, ctypes.POINTER(_LaunchAttribute)), count,
        )  # fmt: skip
        status = drv.lib.cuLaunchKernelEx(ctypes.byref(config), self.function, params, None)
        drv.check(status, "kernel launch (programmatic dependent or clustered)")

    def max_active_clusters(self, block: int, smem: int, cluster_z: int, device) -> int:
        """How many clusters of ``cluster_z`` CTAs (``block`` threads, ``smem`` bytes of dynamic
        shared memory each) the device holds at once (``cuOccupancyMaxActiveClusters``)."""
        drv = _driver()
        self._allow_smem(smem)
        attrs = (_LaunchAttribute * 1)()
        _cluster_attribute(attrs[0], cluster_z)
        config = _LaunchConfig(
            (ctypes.c_uint * 3)(1, 1, cluster_z), (ctypes.c_uint * 3)(block, 1, 1), smem, None,
            ctypes.cast(attrs, ctypes.POINTER(_LaunchAttribute)), 1,
        )  # fmt: skip
        count = ctypes.c_int()
        with torch.cuda.device(device):
            status = drv.lib.cuOccupancyMaxActiveClusters(
                ctypes.byref(count), self.function, ctypes.byref(config)
            )
        drv.check(status, "the occupancy of clusters")
        return count.value


_MODULES: dict[tuple[str, int, tuple[str, ...]], dict[str, Kernel]] = {}


def load(
    source_file: str, names: list[str], device: torch.device, defines: tuple[str, ...] = ()
) -> dict[str, Kernel]:
    """Kernels ``names`` of the CUDA C++ file ``source_file`` (beside this module, or an absolute
    path: the benchmarks' probes), compiled for ``device``'s architecture with the preprocessor
    ``defines`` and loaded into its primary context; cached per process."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (source_file, index, defines)
    with _LOCK:
        if key in _MODULES:
            return _MODULES[key]
        major, minor = torch.cuda.get_device_capability(index)
        arch = f"sm_{major}{minor}a" if major == 9 else f"sm_{major}{minor}"
        source = "".join(f"#define {d}\n" for d in defines)
        source += (Path(__file__).parent / source_file).read_text()
        cubin = compile_cubin(source, Path(source_file).name, arch)
        drv = _driver()
        with torch.cuda.device(index):
            torch.zeros(1, device=f"cuda:{index}")  # torch's primary context, current here
            module = ctypes.c_void_p()
            drv.check(drv.lib.cuModuleLoadData(ctypes.byref(module), cubin), "module load")
            kernels = {}
            for name in names:
                fn = ctypes.c_void_p()
                drv.check(
                    drv.lib.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()),
                    f"finding kernel {name}",
                )
                kernels[name] = Kernel(fn)
        _MODULES[key] = kernels
        return kernels
