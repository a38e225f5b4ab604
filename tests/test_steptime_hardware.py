"""Hardware table for the step-time model: dense peaks (never the sparse figure), the parts of
issue 23, the network fields, and overrides through TORCHLEDGER_HARDWARE."""
import json

import pytest

from torchledger.formulas import hardware
from torchledger.formulas.hardware import get_gpu


# mem_gib: the total the runtime reports (PyTorch's "total capacity" in an OOM message), which
# is below both the datasheet's GB and its GiB: 79.18 GiB = 85.0e9 B for an "80 GB" H100.
@pytest.mark.parametrize("name, bf16_tf, bw_tb, mem_gb, mem_gib", [
    ("H100 SXM", 989.5, 3.35, 80, 79.18),     # 1,979 is the sparse figure: never used
    ("H100 PCIe", 756, 2.0, 80, 79.18),
    ("H100 NVL", 835, 3.9, 94, 93.09),
    ("A100 40GB", 312, 1.555, 40, 39.39),
    ("MI300X", 1307.4, 5.3, 192, 191.98),
    ("L4", 121, 0.3, 24, 22.03),
    ("L40S", 362.05, 0.864, 48, 44.39),
])
def test_dense_peaks_and_memory(name, bf16_tf, bw_tb, mem_gb, mem_gib):
    g = get_gpu(name)
    assert g.peak("bf16") == pytest.approx(bf16_tf * 1e12)
    assert g.bandwidth_bytes_per_s == pytest.approx(bw_tb * 1e12)
    assert g.memory_bytes == pytest.approx(mem_gib * 2**30)
    assert 0.9 * mem_gb * 1e9 < g.memory_bytes < mem_gb * 2**30         # below the label either way
    assert "GiB" in g.sources["memory"]
    assert g.sm_count and g.nvlink_bytes_per_s and g.nic_bytes_per_s
    assert "sparsity" in g.sources["peaks"] or name == "MI300X" or "dense" in g.sources["peaks"]


def test_sparse_figure_is_twice_dense_everywhere():
    # every NVIDIA part with an fp8 figure: fp8 dense = 2 x bf16 dense (within rounding),
    # which a table holding the sparse bf16 figure would break (it would equal fp8)
    for name in ("H100 SXM", "H100 PCIe", "H100 NVL", "L4", "L40S", "MI300X", "B200 SXM"):
        g = get_gpu(name)
        assert g.peak("fp8") == pytest.approx(2 * g.peak("bf16"), rel=0.03)


def test_device_names_resolve():
    assert get_gpu("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert get_gpu("NVIDIA A100-SXM4-40GB").name == "A100 40GB SXM"
    assert get_gpu("AMD Instinct MI300X").name == "MI300X"


def test_env_file_overrides_part_of_a_known_part(tmp_path, monkeypatch, restore_registry):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({
        "H100 SXM": {"efficiency": {"matmul_peak_fraction": 0.5}, "nic": "25GB/s"},
        "Z1": {"memory": "16GB", "bandwidth": "1TB/s", "peak_flops": {"bf16": "100T"}, "sm_count": 10}}))
    monkeypatch.setenv(hardware.HARDWARE_ENV, str(path))
    g = get_gpu("h100")
    assert g.efficiency["matmul_peak_fraction"] == 0.5
    assert g.nic_bytes_per_s == 25e9
    assert g.peak("bf16") == 989.5e12            # the rest as built in
    z = get_gpu("z1")
    assert (z.memory_bytes, z.bandwidth_bytes_per_s, z.peak("bf16"), z.sm_count) == (16e9, 1e12, 100e12, 10)


def test_env_file_new_part_needs_its_figures(tmp_path, monkeypatch, restore_registry):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"Z2": {"efficiency": {}}}))
    monkeypatch.setenv(hardware.HARDWARE_ENV, str(path))
    with pytest.raises(ValueError, match="not a known part"):
        get_gpu("z2")


@pytest.mark.parametrize("name, mem_gib", [
    ("V100 SXM", 31.74), ("A100 SXM", 79.15), ("H200 SXM", 139.80), ("B200 SXM", 178.35),
    ("H100 96GB 500W", 95.0),
])
def test_runtime_memory_of_the_other_parts(name, mem_gib):
    """The parts the table above leaves out: the runtime's total, in GiB, sourced in the row."""
    g = get_gpu(name)
    assert g.memory_bytes == pytest.approx(mem_gib * 2**30)
    assert f"{mem_gib:g}" in g.sources["memory"].replace("139.80", "139.8")
