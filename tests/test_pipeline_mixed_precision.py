"""bf16-mixed and fp16-mixed on every mesh shape with ``pp`` (see test_pipeline_precision.py):
without data parallelism the plan's autocast must reach the stage runner's chunks (it was
dropped: every matmul traced and priced in fp32), with it FSDP2/DDP's MixedPrecisionPolicy."""
import pytest

from _pipeline_models import write_model
from test_pipeline_precision import MESHES, check_pipeline_precision

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("ppmixed"))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("mesh,v,elements,dp", MESHES, ids=[f"{m}-v{v}" for m, v, _, _ in MESHES])
def test_mixed_precision_on_every_pipeline_mesh(tiny4, precision, mesh, v, elements, dp):
    check_pipeline_precision(tiny4, precision, mesh, v, elements, dp)
