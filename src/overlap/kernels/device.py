"""What the run's GPU is: device 0's name and compute capability (probed, or the target `overlap
explain -g` names), and which GPUs DeepEP's kernels support. The flex dispatcher's rules
(`flex_backend`) and the experts' GEMM rule (`grouped_gemm`) read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    """What the kernel rules need to know about a GPU (device 0)."""

    name: str
    major: int


def probe_device() -> DeviceInfo | None:
    """Device 0's name and compute capability, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return DeviceInfo(props.name, props.major)


# What `overlap explain -g GPU` checks the flex-dispatcher rules against: the device each -g names,
# as CUDA reports it (name prefix and compute-capability major). explain describes the target
# cluster, not the machine it runs on; `overlap run` probes the device it actually has. Rubin
# (vr200, r100) is the generation after Blackwell (major 11).
TARGET_DEVICES: dict[str, DeviceInfo | None] = {
    "cpu": None,
    "h100": DeviceInfo("NVIDIA H100", 9),
    "b200": DeviceInfo("NVIDIA B200", 10),
    "b300": DeviceInfo("NVIDIA B300", 10),
    "gb200": DeviceInfo("NVIDIA GB200", 10),
    "gb300": DeviceInfo("NVIDIA GB300", 10),
    "vr200": DeviceInfo("NVIDIA VR200", 11),
    "r100": DeviceInfo("NVIDIA R100", 11),
}


def deepep_supported(dev: DeviceInfo) -> bool:
    """Ampere, Hopper and B200/B300 (GB200/GB300 are not DeepEP-eligible), as in the reference."""
    return dev.major in (8, 9) or dev.name.startswith(("NVIDIA B200", "NVIDIA B300"))


def hybridep_supported(dev: DeviceInfo) -> bool:
    return dev.major in (8, 9, 10)
