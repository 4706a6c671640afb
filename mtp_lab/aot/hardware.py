"""GPU facts the audit compares compiled kernels against: per-architecture limits and per-product SMs/bandwidth.

Nothing here is measured by this project; every number is a published one, with its source.

Per compute capability (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability",
https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#features-and-technical-specifications-technical-specifications-per-compute-capability
and the same table in code, NVIDIA CCCL's arch_traits,
https://github.com/NVIDIA/cccl/blob/main/libcudacxx/include/cuda/__device/arch_traits.h):
65,536 32-bit registers per SM, at most 255 per thread; 1 KiB of shared memory per block reserved by the driver
(sm_80 and later); the per-SM shared memory, the per-block opt-in maximum (= per-SM minus the reserved KiB),
resident blocks and threads per SM below. Register and shared allocation granularity (256 registers per warp,
128 bytes of shared memory) are those of the CUDA occupancy calculator for these architectures
(https://docs.nvidia.com/nsight-compute/NsightCompute/index.html#occupancy-calculator).
"""
import math
from dataclasses import dataclass

KIB = 1024
REGS_PER_SM = 65536
MAX_REGS_PER_THREAD = 255
REG_ALLOC_PER_WARP = 256        # registers are handed to a warp in units of 256
SHARED_ALLOC_UNIT = 128         # bytes
RESERVED_SHARED_PER_BLOCK = 1 * KIB
WARP = 32
SCHEDULERS_PER_SM = 4           # one warp scheduler per SM sub-partition, one warp instruction per cycle each


@dataclass(frozen=True)
class Arch:
    """Limits shared by every GPU of one compute capability."""
    name: str                   # "sm_90"
    capability: int             # 90
    shared_per_sm: int          # bytes
    max_blocks_per_sm: int
    max_threads_per_sm: int
    launcher_sms: int           # SM count the launchers' heuristics see when compiling for this arch
    launcher_sms_note: str

    @property
    def shared_per_block(self):
        """The opt-in per-block maximum: what Triton's launcher checks a kernel's `shared` against."""
        return self.shared_per_sm - RESERVED_SHARED_PER_BLOCK


@dataclass(frozen=True)
class Product:
    """One GPU product: its architecture, SM count, HBM bandwidth and FP32 peak, with the datasheet they come from.

    The clock is derived, not quoted: the datasheet's FP32 (non-tensor) peak = SMs x FP32 lanes per SM x 2 flop per
    FMA x clock (128 lanes per SM on GH100, 64 on GA100: the architecture whitepapers), e.g. 67 TFLOP/s /
    (132 x 128 x 2) = 1.98 GHz for H100 SXM, 19.5 / (108 x 64 x 2) = 1.41 GHz for A100 (its whitepaper's boost clock).
    """
    name: str
    arch: str
    sms: int
    hbm_bytes_per_s: float
    source: str
    fp32_flops: float = 0.0
    fp32_lanes_per_sm: int = 0

    @property
    def clock_hz(self):
        """The boost clock implied by the FP32 peak (0 if the product has none listed)."""
        return self.fp32_flops / (self.sms * self.fp32_lanes_per_sm * 2) if self.fp32_lanes_per_sm else 0.0


ARCHS = {
    "sm_80": Arch("sm_80", 80, 164 * KIB, 32, 2048, 108, "A100's 108 SMs"),
    "sm_90": Arch("sm_90", 90, 228 * KIB, 32, 2048, 132, "H100/H200's 132 SMs"),
    # No product of these two architectures is in the roofline table: their launchers are shown H100's SM count,
    # so the launch parameters (and the kernels compiled) are those of an sm_90-sized grid.
    "sm_100": Arch("sm_100", 100, 228 * KIB, 32, 2048, 132, "stand-in: H100's 132 SMs (no sm_100 product listed)"),
    "sm_120": Arch("sm_120", 120, 100 * KIB, 24, 1536, 132, "stand-in: H100's 132 SMs (no sm_120 product listed)"),
}

PRODUCTS = {
    # 3.35 TB/s, FP32 67 TFLOP/s: H100 SXM datasheet; 132 SMs of 128 FP32 lanes: H100 whitepaper (H100 SXM5)
    "H100": Product("H100", "sm_90", 132, 3.35e12,
                    "https://www.nvidia.com/en-us/data-center/h100/ ; "
                    "https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper", 67e12, 128),
    # 4.8 TB/s, FP32 67 TFLOP/s: H200 datasheet; the same GH100 GPU (132 SMs) with HBM3e
    "H200": Product("H200", "sm_90", 132, 4.8e12,
                    "https://www.nvidia.com/en-us/data-center/h200/ ; "
                    "https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper", 67e12, 128),
    # 2,039 GB/s, FP32 19.5 TFLOP/s: A100 80GB SXM datasheet; 108 SMs of 64 FP32 lanes: Ampere whitepaper
    "A100": Product("A100", "sm_80", 108, 2.039e12,
                    "https://www.nvidia.com/en-us/data-center/a100/ ; "
                    "https://images.nvidia.com/aem-dam/en-zz/Solutions/data-center/"
                    "nvidia-ampere-architecture-whitepaper.pdf", 19.5e12, 64),
}


def products_of(arch_name):
    return [p for p in PRODUCTS.values() if p.arch == arch_name]


def blocks_per_sm(arch, regs, num_warps, shared):
    """Resident blocks per SM for a kernel using `regs` registers/thread, `num_warps` warps and `shared` bytes.

    min over the four limits: registers (allocated per warp, rounded up to 256), shared memory (plus the 1 KiB the
    driver reserves per block, rounded up to 128 B), threads, and blocks. Returns (blocks, limiting resource);
    0 blocks means the kernel cannot launch at all (more than 255 registers or over the shared limit).
    """
    if regs > MAX_REGS_PER_THREAD or shared > arch.shared_per_block:
        return 0, "regs" if regs > MAX_REGS_PER_THREAD else "shared"
    regs_per_warp = math.ceil(max(regs, 1) * WARP / REG_ALLOC_PER_WARP) * REG_ALLOC_PER_WARP
    smem = math.ceil((shared + RESERVED_SHARED_PER_BLOCK) / SHARED_ALLOC_UNIT) * SHARED_ALLOC_UNIT
    limits = {
        "regs": (REGS_PER_SM // regs_per_warp) // num_warps,
        "shared": arch.shared_per_sm // smem,
        "threads": arch.max_threads_per_sm // (num_warps * WARP),
        "blocks": arch.max_blocks_per_sm,
    }
    limiter = min(limits, key=lambda k: limits[k])
    return limits[limiter], limiter


def waves(programs, sms, blocks):
    """How many rounds the grid needs: ceil(programs / (SMs x resident blocks per SM)). None if nothing fits."""
    if blocks <= 0 or sms <= 0:
        return None
    return math.ceil(programs / (sms * blocks))
