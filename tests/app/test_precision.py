"""`bf16: auto`: bf16 autocast only where bf16 is native, said in words; recipes keep "auto" until the
machine that trains resolves it."""

from __future__ import annotations

from otbrl.app.precision import bf16_support, cpu_flags, resolve_bf16
from otbrl.app.recipe import load_recipe, make_config


def test_native_bf16_follows_the_cpu_flags():
    assert bf16_support(use_cpu=True, flags={"avx2", "avx512f", "avx512_bf16"})[0] is True
    assert bf16_support(use_cpu=True, flags={"avx2", "amx_bf16", "amx_tile"})[0] is True
    native, why = bf16_support(use_cpu=True, flags={"avx2", "fma", "avx512f"})  # AVX-512 without BF16
    assert native is False and "emulated" in why


def test_auto_is_resolved_by_make_config_and_explained(tmp_path):
    recipe = load_recipe("demo", {"bf16": "auto", "output_dir": str(tmp_path)})
    assert recipe["bf16"] == "auto"  # kept: the machine that trains decides
    expected = bf16_support(use_cpu=True)[0]
    assert make_config(recipe).bf16 is expected
    value, why = resolve_bf16("auto", use_cpu=True)
    assert value is expected and why.startswith("bf16: auto -> ")
    assert resolve_bf16(True) == (True, None)
    assert make_config(load_recipe("demo", {"output_dir": str(tmp_path)})).bf16 is False


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "sse2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == set()


def test_a_bad_bf16_value_names_auto_too(tmp_path):
    import pytest

    with pytest.raises(ValueError, match=r"bf16: expected true or false, got 'maybe' \(or auto\)"):
        load_recipe("demo", {"bf16": "maybe", "output_dir": str(tmp_path)})
