"""shared.plan_state: the engine sends a request's block table and sampling parameters once,
then increments; the workers rebuild whole seqs. Truth: the scheduler's own block tables."""

from __future__ import annotations

import pytest

from services.engine.block_manager import BlockManager
from services.engine.request import Request
from services.engine.scheduler import Scheduler
from shared import protocol as P
from shared.plan_state import PlanState


def _seq(rid, table, start=0, sampling=P.SamplingParams(temperature=0.5)):
    return P.ScheduledSeq(rid, [1], 0, table, True, sampling, table_start=start)


def test_increments_rebuild_whole_tables_and_parameters():
    st, sp = PlanState(), P.SamplingParams(temperature=0.7, seed=3)
    p1 = st.resolve(P.StepPlan(1, [_seq("a", [4, 5], sampling=sp)]))
    assert (p1.seqs[0].block_table, p1.seqs[0].sampling) == ([4, 5], sp)
    p2 = st.resolve(P.StepPlan(2, [_seq("a", [9], start=2, sampling=None)]))
    assert (p2.seqs[0].block_table, p2.seqs[0].sampling, p2.seqs[0].table_start) == ([4, 5, 9], sp, 0)
    p3 = st.resolve(P.StepPlan(3, [_seq("a", [], start=3, sampling=None)]))
    assert p3.seqs[0].block_table == [4, 5, 9]
    p4 = st.resolve(P.StepPlan(4, [_seq("a", [7, 8])]))  # a new whole table (after a preemption)
    assert p4.seqs[0].block_table == [7, 8]
    st.resolve(P.StepPlan(5, [], forget=["a"]))
    assert st.known == {}


def test_a_held_table_list_only_grows_an_increment_inside_it_gets_a_new_list():
    # the CUDA graphs restage a table list only from where it grew (cuda_graphs.DecodeGraphs.run)
    st = PlanState()
    t1 = st.resolve(P.StepPlan(1, [_seq("a", [4, 5, 6])])).seqs[0].block_table
    t2 = st.resolve(P.StepPlan(2, [_seq("a", [7], start=3, sampling=None)])).seqs[0].block_table
    assert t2 is t1 and t1 == [4, 5, 6, 7]  # appended in place
    t3 = st.resolve(P.StepPlan(3, [_seq("a", [9, 10], start=2, sampling=None)])).seqs[0].block_table
    assert t3 == [4, 5, 9, 10] and t3 is not t1 and t1 == [4, 5, 6, 7]
    t4 = st.resolve(P.StepPlan(4, [_seq("a", [11], start=4, sampling=None)])).seqs[0].block_table
    assert t4 is t3 and t4 == [4, 5, 9, 10, 11] and st.known["a"][1].temperature == 0.5


def test_disagreement_with_the_engine_is_an_error_not_a_wrong_table():
    st = PlanState()
    with pytest.raises(ValueError, match="holds none"):
        st.resolve(P.StepPlan(1, [_seq("x", [3], start=1, sampling=None)]))
    with pytest.raises(ValueError, match="without sampling"):
        st.resolve(P.StepPlan(1, [_seq("y", [3], sampling=None)]))
    st.resolve(P.StepPlan(2, [_seq("z", [1, 2])]))
    with pytest.raises(ValueError, match="from block 5"):
        st.resolve(P.StepPlan(3, [_seq("z", [3], start=5, sampling=None)]))


def test_scheduler_plans_carry_each_table_once_and_forget_ended_requests():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 8, 64, 200, [0])
    reqs = [Request(f"r{i}", b"", list(range(1, 10 + i)),
                    P.SamplingParams(max_tokens=4 + 2 * i, ignore_eos=True)) for i in range(3)]
    for r in reqs:
        sched.add(r)
    st, enc, dec = PlanState(), P.encoder(), P.decoder(P.EngineToWorker)
    sent_blocks, sent_params, steps, forgotten = 0, 0, 0, []
    while sched.has_work():
        out = sched.schedule()
        plan = dec.decode(enc.encode(out.plan))  # as the worker receives it
        sent_blocks += sum(len(s.block_table) for s in plan.seqs)
        sent_params += sum(s.sampling is not None for s in plan.seqs)
        forgotten += plan.forget
        st.resolve(plan)
        for s, r in zip(plan.seqs, out.requests):
            assert s.block_table == r.block_ids and s.sampling == r.sampling
        sched.update(out, [5] * sum(s.sample for s in plan.seqs))
        steps += 1
    assert steps > 3 and sent_params == 3  # each request's parameters went once
    # every block went once: the KV of prompt + outputs but the last output
    assert sent_blocks == sum(-(-(len(r.prompt_token_ids) + r.sampling.max_tokens - 1) // 4) for r in reqs)
    assert forgotten == ["r0", "r1"]  # r2 ended in the last step: no plan came after it
    assert st.known.keys() == {"r2"}
