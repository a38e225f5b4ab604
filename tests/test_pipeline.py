"""Pipeline parallelism: the schedule's closed forms (bubble, in-flight micro-batches, the
cut into chunks) by hand, and two composed audits of a 4-block llama-tiny (1F1B at pp=2;
interleaved at pp=2 x v=2 with FSDP2 over dp=2) checked against hand arithmetic: p2p bytes,
FLOPs per stage, per-stage peaks, FSDP2's collectives once per step."""
from __future__ import annotations


import pytest

from _pipeline_models import TINY4, write_model
from torchledger.formulas.pipeline import bubble_fraction, chunk_sizes, in_flight, rank_chunks

# -- closed forms ------------------------------------------------------------------------------


def test_bubble_by_hand():
    assert bubble_fraction(4, 1, 8, "1f1b") == 3 / 8            # (p - 1) / m
    assert bubble_fraction(4, 2, 8, "interleaved") == 3 / 16    # (p - 1) / (v m)
    assert bubble_fraction(4, 1, 8, "gpipe") == 3 / 8
    assert bubble_fraction(4, 1, 8, "zero-bubble") == 3 / 24    # ZB-H1: a third of 1F1B's
    assert bubble_fraction(9, 7, 18, "interleaved") == 8 / 126
    with pytest.raises(ValueError):
        bubble_fraction(4, 1, 0, "1f1b")


def test_in_flight_by_hand():
    # 1F1B: the first stage holds p micro-batches (Korthikanti App. B), the last one
    assert [in_flight(4, 1, 8, r, "1f1b") for r in range(4)] == [4, 3, 2, 1]
    with pytest.raises(ValueError, match="Schedule1F1B refuses"):   # m < p: PyTorch refuses it
        in_flight(4, 1, 2, 0, "1f1b")
    # interleaved: 2 (p - 1 - r) + (v - 1) p + 1 chunk-micro-batches: r0 2*3 + 4 + 1 = 11
    assert in_flight(4, 2, 8, 0, "interleaved") == 11
    assert in_flight(4, 2, 8, 3, "interleaved") == 5
    assert in_flight(9, 7, 18, 0, "interleaved") == 2 * 8 + 6 * 9 + 1      # 71
    assert in_flight(4, 2, 8, 1, "gpipe") == 16                 # every forward first: m v


def test_in_flight_bytes_by_hand():
    from torchledger.formulas.pipeline import in_flight_bytes
    # 1F1B p=2 m=4, rank 1 (F0 B0 F1 B1 ...): one micro-batch live; its outputs (1 B each)
    # kept to the step's end: the peak after the first backward is the last B, 10 + 4 x 1
    assert in_flight_bytes(2, 1, 4, 1, "1f1b", {1: 10}, {1: 1}) == (14, {1: 1}, {1: 4})
    # interleaved p=2 v=2 m=4, rank 1 holds chunks 1 and 3 (the head's, 100 B a micro-batch):
    # its peak by bytes has one of chunk 3 and two of chunk 1 live: 2 x 1 + 100
    assert in_flight_bytes(2, 2, 4, 1, "interleaved", {1: 1, 3: 100})[:2] == (102, {1: 2, 3: 1})


def test_chunks_by_hand():
    assert chunk_sizes(126, 63) == [2] * 63
    assert chunk_sizes(10, 4) == [3, 3, 2, 2]
    assert rank_chunks(9, 7, 2) == [2, 11, 20, 29, 38, 47, 56]
    with pytest.raises(ValueError):
        chunk_sizes(3, 4)


# -- composed audits ---------------------------------------------------------------------------
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

# llama-tiny, 4 blocks, 4 KV heads, batch 2 x 32 (one micro-batch), fp32. A block's forward:
# 2 x 64 tokens x 50,176 matmul weights = 6,422,528 + attention 4 x 2 x 4 x 32 x 32 x 16 =
# 524,288: 6,946,816 FLOPs. An activation sent between stages: 2 x 32 x 64 x 4 B = 16,384 B.
BLOCK_FWD = 6_946_816
ACT = 2 * 32 * 64 * 4


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("pp"))


@pytest.fixture(scope="module")
def one_f_one_b_run(tiny4):
    from torchledger.audit.engine import run_audit
    return run_audit(tiny4, mesh="pp=2", plan={"micro_batches": 4})


@pytest.fixture(scope="module")
def one_f_one_b(one_f_one_b_run):
    """Rank 0's composed record (the last stage bounds: it holds every micro-batch's logits)."""
    return one_f_one_b_run.stage_records[0]


@pytest.fixture(scope="module")
def interleaved(tiny4):
    from torchledger.audit.engine import run_audit
    return run_audit(tiny4, mesh="dp=2,pp=2", plan={"micro_batches": 4, "virtual_stages": 2}).record


def _stage(rec, r):
    return next(s for s in rec.totals["pipeline"]["per_stage"] if s["rank"] == r)


@pytest.mark.slow
def test_1f1b_stages_flops_and_p2p(one_f_one_b):
    pp = one_f_one_b.totals["pipeline"]
    assert (pp["stages"], pp["virtual_stages"], pp["micro_batches"], pp["schedule"]) == (2, 1, 4, "1f1b")
    assert one_f_one_b.totals["parallel_dims"] == {"pp": 2}
    assert pp["bubble_fraction"] == 1 / 4
    s0, s1 = _stage(one_f_one_b, 0), _stage(one_f_one_b, 1)
    assert s0["blocks"] == s1["blocks"] == 2 and s0["chunks"] == [0] and s1["chunks"] == [1]
    # rank 0: 2 blocks x 4 micro-batches forward (the embedding multiplies nothing)
    assert s0["flops"]["forward"] == 4 * 2 * BLOCK_FWD
    # rank 0 sends its output forward and receives its gradient: 4 x 16,384 each way
    assert s0["comm_bytes"]["forward"] == 4 * ACT and s0["comm_bytes"]["backward"] == 0
    assert s1["comm_bytes"]["backward"] == 4 * ACT and s1["comm_bytes"]["forward"] == 0
    assert s0["p2p_bytes"] == s1["p2p_bytes"] == 2 * 4 * ACT


@pytest.mark.slow
def test_1f1b_first_stage_holds_p_micro_batches(one_f_one_b):
    s0, s1 = _stage(one_f_one_b, 0), _stage(one_f_one_b, 1)
    assert (s0["in_flight"], s1["in_flight"]) == (2, 1)
    # one more micro-batch's activations than the traced micro-step on the first stage (its
    # blocks' and its embedding's); PipelineStage's buffers (issue 30 item 6): rank 0 receives
    # its output's gradient into m buffers (the traced micro-step receives one) and keeps the
    # outputs of its 2 micro-batches in flight; rank 1 receives activations into m buffers
    # (the one in flight is its first block's saved input) and keeps the 3 earlier logits,
    # 2 x 32 x 512 x 4 = 131,072 B each
    assert s0["peak_bytes"] == s0["traced_peak_bytes"] + s0["chunk_micro_batch_bytes"]["0"] + 3 * ACT + 2 * ACT
    assert s0["chunk_micro_batch_bytes"]["0"] > s0["chunk_activation_bytes"] > 0
    assert s1["peak_bytes"] == s1["traced_peak_bytes"] + 3 * ACT + 3 * 131_072
    # the last stage bounds: 4 x 131,072 B of logits outweigh rank 0's second micro-batch
    assert one_f_one_b.totals["pipeline"]["bounding_rank"] == 1 and s1["peak_bytes"] > s0["peak_bytes"]
    assert one_f_one_b.totals["peak_bytes"] == s0["peak_bytes"]
    # rank 0's parameters: 2 blocks x 50,304 + the embedding 32,768 = 133,376 fp32
    assert one_f_one_b.totals["param_bytes"] == 133_376 * 4
    # the report's categories add up to the stage's peak (the extra micro-batch: activations;
    # the stage's buffers: temporaries)
    assert sum(one_f_one_b.memory["peak_breakdown"].values()) == s0["peak_bytes"]
    assert not dist.is_initialized()


@pytest.mark.slow
def test_1f1b_collective_rows_are_sends_and_receives(one_f_one_b):
    rows = {(c["op"], c["phase"]): c for c in one_f_one_b.collectives}
    assert rows[("send", "forward")]["bytes"] == 4 * ACT and rows[("send", "forward")]["count"] == 4
    assert rows[("recv", "backward")]["bytes_received"] == 4 * ACT
    assert not [c for c in one_f_one_b.collectives if c["phase"] == "other"]
    assert {c["location"] for c in one_f_one_b.collectives} == {None}     # torchledger's runner
    # dist.send is isend + wait: one call, one collective, no false "not seen"
    assert not [w for w in one_f_one_b.warnings if w.startswith("collectives not seen")]
    # rank 0's rows: its blocks and embedding, not the placeholders of rank 1's
    names = {m["name"] for m in one_f_one_b.modules}
    assert {"blocks.0", "blocks.1", "tok_emb"} <= names and not names & {"blocks.2", "lm_head"}


@pytest.mark.slow
def test_interleaved_by_hand(interleaved):
    pp = interleaved.totals["pipeline"]
    assert pp["schedule"] == "interleaved" and pp["bubble_fraction"] == 1 / 8
    s0, s1 = _stage(interleaved, 0), _stage(interleaved, 1)
    assert s0["chunks"] == [0, 2] and s1["chunks"] == [1, 3]
    # in flight: r0 2 (p - 1) + (v - 1) p + 1 = 5, r1 3 chunk-micro-batches; the traced
    # micro-step holds v = 2 of them
    assert (s0["in_flight"], s1["in_flight"]) == (5, 3)
    # rank 0's peak (1F of the steady state): 4 micro-batches of chunk 0 and 1 of chunk 2
    # live, 3 more than the traced micro-step's; PipelineStage's buffers: chunk 2 receives
    # activations into m = 4 buffers (the live one is in its activations), both chunks receive
    # their outputs' gradients into 4 (the traced micro-step receives one each), and the 5 live
    # chunk-micro-batches keep their outputs: (3 + 2 x 3 + 5) x 16,384 B
    assert s0["live_at_peak"] == {"0": 4, "2": 1}
    assert s0["stage_buffer_bytes"] == {"activations_received": 3 * ACT, "gradients_received": 2 * 3 * ACT,
                                        "outputs_held": 5 * ACT}
    assert s0["peak_bytes"] == s0["traced_peak_bytes"] + 3 * s0["chunk_micro_batch_bytes"]["0"] + 14 * ACT
    bound = _stage(interleaved, pp["bounding_rank"])
    assert sum(interleaved.memory["peak_breakdown"].values()) == bound["peak_bytes"] == interleaved.totals["peak_bytes"]
    # rank 0's parameters, FSDP2-sharded over dp=2: (2 x 50,304 + 32,768) / 2 = 66,688 fp32
    assert _stage(interleaved, 0)["static_bytes"] >= 66_688 * 4
    # rank 1: one more micro-batch of chunk 1 (3 in flight); buffers (4 - 2) + (4 - 1)
    # activations and 3 gradients received, chunk 1's 2 outputs and the head's 3 earlier
    # logits (2 x 32 x 512 x 4 = 131,072 B each)
    assert s1["live_at_peak"] == {"1": 2, "3": 1}
    assert s1["peak_bytes"] == s1["traced_peak_bytes"] + s1["chunk_micro_batch_bytes"]["1"] + \
        5 * ACT + 3 * ACT + 2 * ACT + 3 * 131_072
    rec = interleaved
    sends = {c["phase"]: c for c in rec.collectives if c["op"] == "send"}
    r = pp["bounding_rank"]
    # rank 0 sends chunk 0's and chunk 2's outputs forward (2 per micro-batch), chunk 2's
    # input gradient back; rank 1 sends chunk 1's output forward, chunks 1's and 3's input
    # gradients back
    fwd, bwd = (2, 1) if r == 0 else (1, 2)
    assert sends["forward"]["bytes"] == 4 * fwd * ACT and sends["backward"]["bytes"] == 4 * bwd * ACT


@pytest.mark.slow
def test_interleaved_fsdp_gathers_and_reduces_once_per_step(interleaved):
    # FSDP2 units on a rank: its 2 blocks and the root; parameters stay gathered across the
    # micro-batches and gradients are reduced on the last one only (as PipelineStage drives it)
    gathers = sum(c["count"] for c in interleaved.collectives if c["op"] == "all_gather")
    reduces = sum(c["count"] for c in interleaved.collectives if c["op"] == "reduce_scatter")
    assert gathers == 3 and reduces == 3
    assert interleaved.meta["audit"]["plan"][-1].endswith("reshard_after_forward=False (pipelined)")


@pytest.mark.slow
def test_step_time_of_the_stage_is_its_m_micro_steps(interleaved):
    """The predicted step of a stage runs its traced micro-step m = 4 times, FSDP2's gathers
    in the first and its reduce-scatters in the last; MFU is the step's FLOPs over it."""
    from torchledger.steptime.predict import op_seconds, predict_step_time
    from torchledger.formulas import steptime as st
    from torchledger.formulas.hardware import get_gpu
    rec = interleaved
    for c in rec.collectives:       # how many of the 4 micro-steps issue the row
        assert c["micro_steps"] == (1 if c["op"] in ("all_gather", "reduce_scatter") else 4), c
    h100 = get_gpu("h100")
    eff = st.efficiency(h100)
    p = predict_step_time(rec, h100)
    assert p["micro_batches"] == 4
    fwd = sum(op_seconds(r, h100, eff, "fp32")["seconds"] for r in rec.ops if r["phase"] == "forward")
    assert fwd > 0 and p["by_phase"]["forward"] == pytest.approx(4 * fwd)
    # bubble (p - 1) / (v m) = 1 / 8 of the 4 micro-steps' forward and backward
    compute = sum(p["by_phase"].get(k, 0) for k in ("forward", "backward", "recompute"))
    assert p["bubble_seconds"] == pytest.approx(compute / 8)
    assert p["mfu"] == pytest.approx(rec.totals["flops"]["total"] / p["seconds"] / st.dense_peak(h100, "fp32", eff))
    # the step's global tokens / s / world size: dp=2 ranks of 4 x 2 x 32 tokens over 4 GPUs,
    # each pp pair processing one dp rank's tokens: 256 / s / 2
    assert p["tokens_per_s_per_gpu"] == pytest.approx(rec.totals["tokens"] / p["seconds"] / 2)
    assert rec.totals["tokens"] == 4 * 2 * 32                  # 4 micro-batches of 2 x 32


@pytest.mark.slow
def test_references_are_the_stages(one_f_one_b):
    """The closed forms of a stage describe what it holds: rank 0's 2 blocks and the embedding
    (no final norm, no head), and the activations of one micro-batch in as many layers as its
    schedule keeps (the 405B stage read 0.957x of the whole model's ends)."""
    rows = {r["quantity"]: r for r in one_f_one_b.predictions["comparisons"]}
    assert one_f_one_b.totals["rank"] == 0
    # 2 x 50,304 + 32,768 = 133,376 (the whole model's formula adds the norm 64 and head 32,768)
    exact = rows["parameters (exact formula)"]
    assert exact["predicted"] == exact["measured"] == 133_376
    assert exact["explanation"].startswith("pipeline stage: its 2 blocks and the embedding")
    # 12 L d^2 + V d = 12 x 2 x 64^2 + 512 x 64 = 98,304 + 32,768 = 131,072
    assert rows["parameters (12*L*d^2 + V*d)"]["predicted"] == 131_072
    # Korthikanti per layer, one micro-batch (s = 32, b = 2, h = 64; fused attention: no s x s
    # scores): 34 sbh = 34 x 32 x 2 x 64 = 139,264 B; rank 0 holds its 2 blocks of the traced
    # micro-batch and, under 1F1B at p = 2, one more micro-batch of its chunk (2 blocks): 4 layers
    act = rows["activation bytes vs Korthikanti (16-bit)"]
    assert act["predicted"] == 4 * 139_264
    assert "one micro-batch (64 tokens) x 4 layers" in act["explanation"]


@pytest.mark.slow
def test_the_report_names_the_bounding_stage(one_f_one_b_run):
    one_f_one_b = one_f_one_b_run.record
    from torchledger.render.common import run_notes
    from torchledger.units import fmt_bytes
    [line] = [x for x in run_notes(one_f_one_b) if x.startswith("pipeline:")]
    s0, s1 = _stage(one_f_one_b, 0), _stage(one_f_one_b, 1)
    assert "2 stages x 1 virtual, 4 micro-batches, 1f1b (bubble 0.250)" in line
    assert "this report is stage 1's, the largest peak (2 blocks and the head)" in line
    assert f"peak per stage: 0 {fmt_bytes(s0['peak_bytes'], True)}, 1 {fmt_bytes(s1['peak_bytes'], True)}" in line


def test_the_pipeline_line_groups_alike_ranks():
    from torchledger.render.common import pipeline_line
    stages = [{"rank": 0, "ranks_alike": [0], "blocks": 14, "embedding": True, "peak_bytes": 3 * 2 ** 30},
              {"rank": 1, "ranks_alike": list(range(1, 8)), "blocks": 14, "peak_bytes": 2 * 2 ** 30},
              {"rank": 8, "ranks_alike": [8], "blocks": 14, "head": True, "peak_bytes": 2 ** 30}]
    line = pipeline_line({"pipeline": {"stages": 9, "virtual_stages": 7, "micro_batches": 18,
                                       "schedule": "interleaved", "bubble_fraction": 8 / 126,
                                       "bounding_rank": 0, "per_stage": stages}})
    assert "peak per stage: 0 3.0 GiB, 1-7 2.0 GiB, 8 1.0 GiB" in line and "(bubble 0.063)" in line
    assert pipeline_line({"flops": {}}) is None


@pytest.fixture(scope="module")
def mixed(tiny4):
    from torchledger.audit.engine import run_audit
    return run_audit(tiny4, mesh="dp=2,pp=2", plan={"micro_batches": 2, "precision": "bf16-mixed"}).record


def _static_row(rec):
    return next(c for c in rec.predictions["comparisons"] if c["quantity"].startswith("static bytes"))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["interleaved", "mixed"])
def test_static_bytes_are_the_stage_shards(case, request):
    """The measured static bytes of a stage are its parameters' shards as the step starts:
    later micro-steps see FSDP2's gathered parameters (and the optimizer's sharded ones as
    'master weights'), which made the 405B stage 17.7x its reference."""
    rec = request.getfixturevalue(case)
    t = rec.totals
    # the bounding rank's params sharded over dp=2: rank 0 (2 x 50,304 + embedding 32,768) / 2
    # = 66,688; rank 1 (2 x 50,304 + head 32,768 + norm 64) / 2 = 66,720 fp32 shards (FSDP2's
    # MixedPrecisionPolicy keeps the shards in fp32; bf16 is the gathered copy)
    n = {0: 66_688, 1: 66_720}[t["pipeline"]["bounding_rank"]]
    assert t["param_bytes"] == t["trainable_param_bytes"] == 4 * n
    assert rec.optimizer["master_weight_bytes"] == 0
    row = _static_row(rec)
    # 16 B per param: fp32 weight 4 + gradient 4 + AdamW's two moments 8
    assert row["predicted"] == 16 * n
    # measured: the same, plus AdamW's fp32 step scalar per parameter tensor (a few dozen B)
    assert 0 < row["measured"] - 16 * n <= 4 * 20 and row["ratio"] < 1.001


def test_micro_batches_from_the_global_batch():
    from torchledger.parallel.layout import parse_layout
    from torchledger.audit.pipeline import _micro_batches
    from torchledger.audit.spec import AuditError
    lay = parse_layout("dp=2,pp=4")
    assert _micro_batches(lay, 2, 4) == 4                                   # default: pp
    assert _micro_batches(lay.with_options(global_batch=32), 2, 4) == 8     # 32 / (2 x 2)
    assert _micro_batches(lay.with_options(micro_batches=6), 2, 4) == 6
    with pytest.raises(AuditError, match="not a multiple of dp x the spec's batch"):
        _micro_batches(lay.with_options(global_batch=30), 2, 4)


def test_more_stages_than_blocks_is_one_line(tiny4):
    from click.testing import CliRunner
    from torchledger.cli import cli
    from test_audit_cli import one_line_error
    one_line_error(CliRunner().invoke(cli, ["audit", tiny4, "--mesh", "pp=4", "--virtual-stages", "2"]),
                   "4 blocks cannot fill 8 pipeline chunks", "fewer stages")


# A head-heavy last stage under a first stage that holds more: vocabulary 256, 4 x 256 tokens
# a micro-batch, 8 micro-batches. Rank 0 holds p = 2 micro-batches of its blocks in flight
# (1F1B) and bounds the memory; rank 1 runs the head and the loss on every micro-batch and is
# the slower one: the step is priced on it (it used to follow the highest-memory stage).
HEADY = TINY4.replace("n_layers=4)", "n_layers=4, vocab_size=256)").replace("(2, 32)", "(4, 256)")


@pytest.mark.slow
def test_the_step_is_priced_on_the_slowest_stage(tmp_path):
    import json
    from click.testing import CliRunner
    from torchledger.cli import cli
    path = write_model(tmp_path, HEADY, "heady.py")
    out = tmp_path / "a.json"
    res = CliRunner().invoke(cli, ["audit", path, "--mesh", "pp=2", "--micro-batches", "8", "--gpu", "h100",
                                   "--precision", "bf16-mixed", "--kernels", "te", "--format", "json",
                                   "--output", str(out)])
    assert res.exit_code in (0, 1), res.output
    d = json.loads(out.read_text())
    pipe, p = d["totals"]["pipeline"], d["predictions"]["step_time"]
    assert pipe["bounding_rank"] == 0
    secs = {s["rank"]: s["predicted_seconds"] for s in pipe["per_stage"]}
    assert secs[1] > secs[0] > 0
    assert p["seconds"] == pytest.approx(secs[1])
    assert "slowest's, rank 1" in p["assumptions"][-1] and "bounding (highest-memory) rank 0" in p["assumptions"][-1]
    # the slowest stage is priced as the audit asked (its own record carries --kernels)
    assert any(a.startswith("kernels te") for a in p["assumptions"])
    # tokens per GPU: the step's 8 x 4 x 256 tokens over pp = 2 GPUs
    assert p["tokens_per_s_per_gpu"] == pytest.approx(8 * 4 * 256 / 2 / p["seconds"])


# -- issue 33 item 5: the composition with v > 1, modules over m, m = 1 ------------------------------

@pytest.mark.slow
def test_an_extra_chunk_micro_batch_holds_one_chunks_activations(interleaved):
    # v = 2: a rank's 2 blocks are 2 chunks of 1 block; an extra chunk-micro-batch in flight
    # holds one block's activations (half the rank's), not the rank's two
    bound = _stage(interleaved, interleaved.totals["pipeline"]["bounding_rank"])
    rows = {m["name"]: m for m in interleaved.modules}
    blocks = [rows[n]["activation_bytes"] for n in rows if n.count(".") == 1 and n.startswith("blocks.")]
    assert len(blocks) == 2
    assert bound["chunk_activation_bytes"] == sum(blocks) // 2


@pytest.mark.slow
def test_composed_module_flops_are_the_m_micro_steps(one_f_one_b):
    # rank 0's blocks.0 row: 4 micro-batches x 6,946,816 forward FLOPs
    rows = {m["name"]: m for m in one_f_one_b.modules}
    assert rows["blocks.0"]["flops_forward"] == 4 * BLOCK_FWD
    assert rows["blocks.0"]["flops_backward"] == 2 * 4 * BLOCK_FWD


@pytest.mark.slow
def test_one_micro_batch_still_reduces_and_steps(tiny4):
    """--micro-batches 1 (GPipe: 1F1B refuses m < p): the one micro-step is the first and the
    last, so FSDP2 gathers and reduce-scatters every unit and the optimizer steps."""
    from torchledger.audit.engine import run_audit
    rec = run_audit(tiny4, mesh="dp=2,pp=2", plan={"micro_batches": 1, "schedule": "gpipe"}).record
    assert rec.totals["pipeline"]["bounding_rank"] == 1
    rs = [c for c in rec.collectives if c["op"] == "reduce_scatter"]
    # rank 1's units: blocks 2 and 3 (50,304 fp32 parameters each) and the root (the head
    # 32,768 + the final norm 64): 3 calls of the unsharded gradients, 2 x 201,216 + 131,328 B
    assert sum(c["count"] for c in rs) == 3
    assert sorted(c["bytes"] for c in rs) == [131_328, 201_216, 201_216]
    assert any(o["phase"] == "optimizer" for o in rec.ops)
