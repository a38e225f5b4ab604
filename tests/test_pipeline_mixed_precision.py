"""bf16-mixed and fp16-mixed on every mesh shape with ``pp`` (see test_pipeline_precision.py):
without data parallelism the plan's autocast must reach the stage runner's chunks (it was
dropped: every matmul traced and priced in fp32), with it FSDP2/DDP's MixedPrecisionPolicy."""
import pytest

from test_pipeline_precision import MESHES, TINY4, check_pipeline_precision  # noqa: F401

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    import textwrap
    p = tmp_path_factory.mktemp("ppmixed") / "tiny4.py"
    p.write_text(textwrap.dedent(TINY4))
    return str(p)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("mesh,v,elements,dp", MESHES, ids=[f"{m}-v{v}" for m, v, _, _ in MESHES])
def test_mixed_precision_on_every_pipeline_mesh(tiny4, precision, mesh, v, elements, dp):
    check_pipeline_precision(tiny4, precision, mesh, v, elements, dp)
