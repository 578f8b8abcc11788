"""Issue 10: the numbers are true on the loops people write (copies, closures, clipping, LR
schedules, accumulation, several models) — each test fails on the probe before its fix."""

from __future__ import annotations

import copy
import functools
import io
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from changed_runs import changed_run, replaced_head_run
from changed_runs import fixed_batch as _data
from changed_runs import small_model as _model
from conftest import Loop, OpenReader, Reader, inject_fault, reader_on, wait_until
from waiting import TIMEOUT

import tdbg
from tdbg.probe import faults


def test_a_watched_model_saves_copies_and_pickles_as_without_tdbg(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    reader = probe_reader(probe)
    loop.run(2, probe)
    buffer = io.BytesIO()
    torch.save(loop.model, buffer)  # the whole module, hooks included: word_language_model
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(loop.model)  # an EMA / best-model copy
    opt_twin = copy.deepcopy(loop.optimizer)
    pickle.loads(pickle.dumps(loop.optimizer.state_dict()))  # noqa: S301 (our own bytes)
    pickle.loads(pickle.dumps(loop.model.state_dict()))  # noqa: S301
    for clone in (loaded, twin):
        assert torch.equal(clone(loop.x), loop.model(loop.x))
    # The copies report nothing into the original probe: their forwards and steps are inert.
    before = probe.steps
    twin(loop.x).sum().backward()
    opt_twin.step()
    assert probe.steps == before
    loop.run(2, probe)  # the original still reports
    reader.wait(lambda r: len(r.records()) >= 4)
    assert [r.step for r in reader.records()] == [0, 1, 2, 3]
    reader.close()


def test_a_watched_model_compiles(runtime_dir: Path) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    compiled = torch.compile(loop.model, backend="eager")
    for _ in range(3):
        loop.optimizer.zero_grad()
        loss = ((compiled(loop.x) - loop.y) ** 2).mean()
        loss.backward()
        loop.optimizer.step()
        probe.step(loss)
    assert probe.steps == 3 and probe.errors == 0


def test_a_copied_probe_hook_is_inert_and_holds_nothing() -> None:
    from tdbg.probe.training.hook_refs import INERT_EVENT, WeakHook

    class Target:
        calls = 0

        def hit(self, *args: object) -> None:
            self.calls += 1

    target = Target()
    hook = WeakHook(target.hit)
    hook(1)
    assert target.calls == 1
    for inert in (copy.deepcopy(hook), copy.copy(hook), pickle.loads(pickle.dumps(hook))):  # noqa: S301
        # functools.partial(sys.audit, INERT_EVENT): stdlib only, any arguments, returns None
        assert inert(1, 2, {"k": 3}) is None and target.calls == 1  # hooks get positionals
        assert isinstance(inert, functools.partial) and inert.args == (INERT_EVENT,)
    del target
    assert hook(1) is None  # the probe's object is gone: nothing kept it alive


def _norms(params: list[torch.nn.Parameter]) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    assert len(grads) == len(params), "every parameter has its gradient"
    return float(torch.sqrt(torch.stack([(g.double() ** 2).sum() for g in grads]).sum()))


def test_closure_steps_report_the_gradients_the_update_used(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    probe = tdbg.watch(model, opt, grad_every=1)
    reader = probe_reader(probe)
    truth: list[tuple[float, float]] = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        truth.append((loss.item(), _norms(list(model.parameters()))))
        return loss

    for _ in range(5):
        opt.step(closure)
        probe.step()  # no loss given: the closure's
    reader.wait(lambda r: len(r.records()) >= 5)
    reader.settle()
    records = reader.records()
    for record, (loss, total) in zip(records, truth, strict=True):
        assert record.loss == pytest.approx(loss, rel=1e-6)
        assert record.grad_total == pytest.approx(total, rel=1e-5)
        assert record.backward_time >= 0
    assert not [a for a in reader.of("alert") if a["kind"] == "no_grad"]
    reader.close()


def test_clipping_shows_the_norm_before_the_clip_and_that_it_clipped(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    from torch.nn.utils import clip_grad_norm_  # bound before watch(), as scripts do

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = _data()
    probe = tdbg.watch(model, opt, grad_every=1)
    reader = probe_reader(probe)
    returned = []
    for _ in range(4):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        returned.append(float(clip_grad_norm_(model.parameters(), max_norm=0.5)))
        opt.step()
        probe.step(loss)
    reader.wait(lambda r: len(r.records()) >= 4)
    for record, total in zip(reader.records(), returned, strict=True):
        assert total > 0.5  # the clip was active
        assert record.grad_total == pytest.approx(total, rel=1e-5)  # before, not ~0.5 after
        assert record.clip_max == 0.5
        assert record.clip_norm == pytest.approx(total, rel=1e-6)
    reader.close()


def test_the_lr_of_step_k_is_the_one_its_update_used(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    x, y = _data()
    probe = tdbg.watch(model, opt, grad_every=1)
    reader = probe_reader(probe)
    used = []
    for _ in range(8):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        probe.step(loss)
    reader.wait(lambda r: len(r.records()) >= 8)
    assert [r.lr[0] for r in reader.records()] == used
    assert used[2] != used[3]  # the schedule changed in there
    reader.close()


def test_a_step_pre_hook_registered_before_watch_runs_before_the_probe_reads(
    runtime_dir: Path,
    probe_reader: OpenReader,
) -> None:
    """A script's own step pre-hooks, registered before the probe existed (as under ``tdbg
    run``, which starts it at the first backward), run before the probe reads the step: the LR
    a warmup hook sets, the gradients a hook rescales, are what the update used and what the
    probe shows; and ``skip_nonfinite`` judges the gradients the hook repaired, not the raw
    ones (a review found the probe reading first, so every one of these wrong)."""
    from norm_oracle import reference_norms

    from tdbg.probe.training.gradients import find_layers

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    calls = [0]

    def warmup_and_repair(optimizer: Any, args: Any, kwargs: Any) -> None:
        calls[0] += 1
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * calls[0]
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5).nan_to_num_(1.0, 1.0, -1.0)

    opt.register_step_pre_hook(warmup_and_repair)
    x, y = _data()
    probe = tdbg.watch(model, opt, grad_every=1, skip_nonfinite=True)
    reader = probe_reader(probe)
    used, totals = [], []
    for step in range(4):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        (loss * float("nan") if step == 2 else loss).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()  # the hook halves (and repairs) the gradients, then the update uses them
        totals.append(reference_norms(find_layers(model))[0])
        used.append(opt.param_groups[0]["lr"])
        after = list(model.parameters())
        updated = any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
        assert updated, f"step {step}: the repaired update was skipped"
        probe.step(loss)
    reader.wait(lambda r: len(r.records()) >= 4)
    records = reader.records()
    assert [r.lr[0] for r in records] == used == [0.01, 0.02, 0.03, 0.04]
    for record, total in zip(records, totals, strict=True):
        assert abs(record.grad_total - total) <= 1e-5 * total
    assert probe._sampler.skipped_steps == 0
    reader.close()
    probe.close()


def test_gradient_accumulation_reports_the_whole_update(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    probe = tdbg.watch(model, opt, grad_every=1)
    reader = probe_reader(probe)
    k = 4
    means = []
    for _ in range(3):
        opt.zero_grad()
        parts = []
        for i in range(k):
            loss = ((model(x[i::k]) - y[i::k]) ** 2).mean()
            parts.append(loss.item())
            (loss / k).backward()  # nanoGPT's way
        opt.step()
        probe.step()  # the sum of the scaled micro-batch losses: their mean
        means.append(sum(parts) / k)
    reader.wait(lambda r: len(r.records()) >= 3)
    records = reader.records()
    assert [r.loss for r in records] == pytest.approx(means, rel=1e-6)
    assert [r.micro_batches for r in records] == [k, k, k]
    reader.close()


def test_several_losses_backpropagated_in_one_call_are_the_step_s_loss(
    runtime_dir: Path,
    probe_reader: OpenReader,
) -> None:
    """A multi-task loop's ``torch.autograd.backward([a, b])``: the step's loss is a + b (the
    loss of one backward of their sum), one micro-batch; under accumulation, the sum over the
    calls. Before, such a call was not seen at all: the step had no loss."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    probe = tdbg.watch(model, opt, grad_every=1)
    reader = probe_reader(probe)
    expected, micro = [], []
    for step in range(4):
        calls = 1 if step < 2 else 2
        opt.zero_grad()
        total = 0.0
        for i in range(calls):
            out = model(x[i::calls])
            first = ((out - y[i::calls]) ** 2).mean()
            second = out.abs().mean()
            torch.autograd.backward((first, second))
            total += first.item() + second.item()
        opt.step()
        probe.step()
        expected.append(total)
        micro.append(calls)
    reader.wait(lambda r: len(r.records()) >= 4)
    records = reader.records()
    assert [r.loss for r in records] == pytest.approx(expected, rel=1e-6)
    assert [r.micro_batches for r in records] == micro
    assert probe.errors == 0
    reader.close()


def test_an_explicit_loss_under_accumulation_is_the_update_s(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    """probe.step(loss) with the variable at hand after k micro-batches (nanoGPT's
    ``loss = loss / k; loss.backward()``): that is the last micro-batch divided by k, not the
    update's loss; the step shows what was backpropagated for the update (their mean) and says
    so once. Any other loss passed is the user's own, shown as given, with the micro-batches."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    probe = tdbg.watch(model, opt, grad_every=1)
    reader = probe_reader(probe)
    k = 4
    means, own = [], []
    for step in range(4):
        opt.zero_grad()
        parts = []
        for i in range(k):
            loss = ((model(x[i::k]) - y[i::k]) ** 2).mean()
            parts.append(loss.item())
            loss = loss / k
            loss.backward()
        opt.step()
        means.append(sum(parts) / k)
        if step < 2:
            probe.step(loss)  # the last micro-batch / k
        else:
            own.append(parts[-1])
            probe.step(parts[-1])  # a number of the user's own: kept
    reader.wait(lambda r: len(r.records()) >= 4)
    records = reader.records()
    assert [r.loss for r in records[:2]] == pytest.approx(means[:2], rel=1e-6)
    assert [r.loss for r in records[2:]] == pytest.approx(own, rel=1e-6)
    assert [r.micro_batches for r in records] == [k] * 4
    notes = [a["message"] for a in reader.of("alert") if "micro-batches" in a["message"]]
    assert len(notes) == 1 and "last of the 4 micro-batches" in notes[0]
    reader.close()


def test_micro_batches_are_counted_per_optimizer(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    """DCGAN: the discriminator backpropagates a real and a fake loss, then the generator one:
    the step (the first optimizer's update, optD) had 2 micro-batches, not 3."""
    netG, netD = _model(1), _model(2)
    optD = torch.optim.SGD(netD.parameters(), lr=0.1)
    optG = torch.optim.Adam(netG.parameters(), lr=1e-3)
    x, y = _data()
    probe = tdbg.watch([netD, netG], [optD, optG], grad_every=1)
    reader = probe_reader(probe)
    truth = []
    for _ in range(3):
        optD.zero_grad()
        real = ((netD(x) - y) ** 2).mean()
        real.backward()
        fake = (netD(x * netG(x).detach()) ** 2).mean()
        fake.backward()
        optD.step()
        optG.zero_grad()
        loss_g = ((netD(x * netG(x)) - 1) ** 2).mean()
        loss_g.backward()
        optG.step()
        probe.step()
        truth.append(real.item() + fake.item())
    reader.wait(lambda r: len(r.records()) >= 3)
    records = reader.records()
    assert [r.micro_batches for r in records] == [2, 2, 2]
    assert [r.loss for r in records] == pytest.approx(truth, rel=1e-6)
    reader.close()


def test_several_models_and_optimizers_are_all_watched(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    netG, netD = _model(1), _model(2)
    optG = torch.optim.Adam(netG.parameters(), lr=1e-3)
    optD = torch.optim.SGD(netD.parameters(), lr=0.1)
    x, y = _data()
    probe = tdbg.watch([netG, netD], [optG, optD], grad_every=1)
    reader = probe_reader(probe)
    reader.wait(lambda r: r.of("synced"))
    run = reader.client.run
    assert run["models"] == ["netG", "netD"]
    assert [o["name"] for o in run["optimizers"]] == ["optG", "optD"]
    layers = reader.of("layers")[0]
    assert layers["names"] == ["netG.0", "netG.2", "netD.0", "netD.2"]
    assert layers["model"] == [0, 0, 1, 1]
    truth = []
    for _ in range(3):
        optD.zero_grad()
        loss_d = ((netD(x) - y) ** 2).mean()
        loss_d.backward()
        optD.step()
        optG.zero_grad()
        loss_g = (netG(x) ** 2).mean()
        loss_g.backward()
        optG.step()
        probe.step()
        truth.append((loss_g.item(), loss_d.item()))
    reader.wait(lambda r: len(r.records()) >= 3)
    reader.wait(lambda r: sum(len(m["points"]) for m in r.of("metrics")) >= 6)
    records = reader.records()
    points = [p for m in reader.of("metrics") for p in m["points"]]
    for step, (loss_g, loss_d) in enumerate(truth):
        assert [v for s, n, v in points if s == step and n == "loss/optD"] == [
            pytest.approx(loss_d, rel=1e-6)
        ]
        assert [v for s, n, v in points if s == step and n == "loss/optG"] == [
            pytest.approx(loss_g, rel=1e-6)
        ]
        assert records[step].loss == pytest.approx(loss_g, rel=1e-6)  # the first optimizer's
        assert len(records[step].lr) == 2 and records[step].grad_norms is not None
        assert all(v > 0 for v in records[step].grad_norms)
    reader.close()


def test_thousands_of_param_groups_keep_monitoring_on(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(150)])
    groups = [{"params": [p], "lr": 0.01 * (1 + i % 3)} for i, p in enumerate(model.parameters())]
    opt = torch.optim.SGD(groups, lr=0.01)
    probe = tdbg.watch(model, opt, grad_every=1)
    reader = probe_reader(probe)
    x = torch.randn(3, 2)
    for _ in range(3):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        probe.step(loss)
    reader.wait(lambda r: len(r.records()) >= 3)
    assert all(len(r.lr) == 64 for r in reader.records())
    assert probe.errors == 0
    reader.wait(lambda r: any("300 param groups" in a["message"] for a in r.of("alert")))
    reader.close()


def test_a_bare_module_is_named_after_its_variable_and_a_clean_end_is_not_disabled(
    tmp_path: Path,
) -> None:
    from tdbg.recording.reader import Recording

    head = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    path = tmp_path / "run.tdbg"
    probe = tdbg.watch(head, opt, serve=False, record=path)
    for _ in range(2):
        opt.zero_grad()
        loss = head(torch.ones(2, 3)).sum()
        loss.backward()
        opt.step()
        probe.step(loss)
    probe.close()
    messages = list(Recording(path).messages())
    assert [m["names"] for m in messages if m.get("type") == "layers"] == [["head"]]
    last = [m for m in messages if m.get("type") == "probe"][-1]
    assert last["disabled"] is False and last["closed"] is True


def test_user_metrics_arrive_and_bad_ones_are_reported_once(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    reader = probe_reader(probe)
    loop.run(2, probe)
    tdbg.log(val_loss=0.5, acc=torch.tensor(0.75))  # module level: the live probe
    probe.log({"val/ppl": 12.0}, step=0)
    tdbg.log(loss_scale=float("nan"))  # recorded, and an alert
    for _ in range(2):
        tdbg.log(bad=object())  # reported once, dropped
        probe.log({3: 1.0})  # type: ignore[dict-item]
    tdbg.log(**{f"m{i}": float(i) for i in range(300)})  # capped, with a note
    loop.run(1, probe)
    # The cap's note is about the last call: the probe thread drains tdbg.log calls in order,
    # perhaps over several ticks, so the note means every call before it has been handled (the
    # NaN's alert alone could come a tick before the bad names). settle() then makes "reported
    # once" an event: nothing more was sent.
    reader.wait(lambda r: any("more than 256 metric names" in a["message"] for a in r.of("alert")))
    reader.settle()
    assert any(a["kind"] == "nonfinite_metric" for a in reader.of("alert"))
    points = [tuple(p) for m in reader.of("metrics") for p in m["points"]]
    assert (1, "val_loss", 0.5) in points and (1, "acc", 0.75) in points
    assert (0, "val/ppl", 12.0) in points
    assert any(n == "loss_scale" and v != v for _, n, v in points)
    names = {n for _, n, _ in points}
    assert "bad" not in names and len(names) == 256
    messages = [a["message"] for a in reader.of("alert")]
    assert sum("cannot read a number from object" in m for m in messages) == 1
    assert sum("must be a non-empty string" in m for m in messages) == 1
    assert sum("more than 256 metric names" in m for m in messages) == 1
    assert probe.errors == 0
    reader.close()
    probe.close()
    tdbg.log(after=1.0)  # nothing watched: a no-op


def test_metrics_reach_a_late_client_and_the_recording(
    runtime_dir: Path, tmp_path: Path, probe_reader: OpenReader
) -> None:
    from tdbg.recording.reader import Recording

    loop = Loop()
    path = tmp_path / "m.tdbg"
    probe = tdbg.watch(loop.model, loop.opt, record=path)
    loop.run(2, probe)
    tdbg.log(val_loss=0.25)
    live = probe_reader(probe)
    loop.run(1, probe)
    live.wait(lambda r: r.of("metrics"))  # the probe thread has it: now a late client
    reader = probe_reader(probe)
    reader.wait(lambda r: r.of("synced"))
    assert [tuple(p) for m in reader.of("metrics") for p in m["points"]] == [(1, "val_loss", 0.25)]
    assert all(m.get("history") for m in reader.of("metrics"))
    reader.close()
    live.close()
    probe.close()
    recorded = [m for m in Recording(path).messages() if m.get("type") == "metrics"]
    assert [tuple(p) for m in recorded for p in m["points"]] == [(1, "val_loss", 0.25)]


def test_epochs_follow_the_training_dataloader(runtime_dir: Path, probe_reader: OpenReader) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    loop = Loop()
    train = DataLoader(TensorDataset(loop.x, loop.y), batch_size=16)
    val = DataLoader(TensorDataset(loop.x, loop.y), batch_size=32)
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    reader = probe_reader(probe)
    for _ in range(3):
        for x, y in train:
            loop.optimizer.zero_grad()
            loss = ((loop.model(x) - y) ** 2).mean()
            loss.backward()
            loop.optimizer.step()
            probe.step(loss)
        with torch.no_grad():
            for x, _ in val:  # validation passes are not epochs
                loop.model(x)
    reader.wait(lambda r: len(r.records()) >= 6)
    assert [r.epoch for r in reader.records()] == [0, 0, 1, 1, 2, 2]
    probe.set_progress(epoch=7, total_steps=100)
    loop.run(1, probe)
    reader.wait(lambda r: len(r.records()) >= 7)
    assert reader.records()[-1].epoch == 7
    reader.wait(lambda r: any(m.get("total_steps") == 100 for m in r.of("probe")))
    reader.close()


def test_epochs_follow_a_dataloader_made_anew_each_epoch(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    loop = Loop()
    data = TensorDataset(loop.x, loop.y)
    held = TensorDataset(loop.x[:8], loop.y[:8])
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    reader = probe_reader(probe)

    def train(x: torch.Tensor, y: torch.Tensor) -> None:
        loop.optimizer.zero_grad()
        loss = ((loop.model(x) - y) ** 2).mean()
        loss.backward()
        loop.optimizer.step()
        probe.step(loss)

    for _ in range(2):
        loader = DataLoader(data, batch_size=16, shuffle=True)  # a new one each epoch
        for i, (x, y) in enumerate(loader):
            train(x, y)
            if i == 0:
                with torch.no_grad():  # mid-epoch validation: not an epoch
                    for vx, _ in DataLoader(held, batch_size=4):
                        loop.model(vx)
    for x, y in DataLoader(data, batch_size=16):  # made inline: gone before its first step
        train(x, y)
    reader.wait(lambda r: len(r.records()) >= 6)
    assert [r.epoch for r in reader.records()] == [0, 0, 1, 1, 2, 2]
    reader.close()


def test_a_replaced_layer_and_optimizer_are_followed(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    probe = tdbg.watch(model, opt, grad_every=1)
    reader = probe_reader(probe)

    def run(n: int) -> list[list[float]]:
        norms = []
        for _ in range(n):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            norms.append([_norms(list(m.parameters())) for m in model if list(m.parameters())])
            opt.step()
            probe.step(loss)
        return norms

    run(3)
    model[2] = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 1))  # new head
    opt = torch.optim.SGD(model.parameters(), lr=0.2)  # and a new optimizer for it
    after = run(3)
    reader.wait(lambda r: len(r.records()) >= 6)
    reader.wait(lambda r: len(r.of("layers")) >= 2)
    layers = reader.of("layers")[-1]
    assert layers["names"] == ["0", "2", "2.0", "2.1"] and layers["gone"] == [1]
    records = reader.records()
    assert [r.lr for r in records] == [[0.05]] * 3 + [[0.2]] * 3
    for record, truth in zip(records[3:], after, strict=True):
        norms = record.grad_norms
        assert norms is not None and norms[0] == pytest.approx(truth[0], rel=1e-5)
        assert norms[1] != norms[1]  # gone: no norm, not a frozen old value
        head = (norms[2] ** 2 + norms[3] ** 2) ** 0.5
        assert head == pytest.approx(truth[1], rel=1e-5)
    assert not [
        a for a in reader.of("alert") if a["kind"] in ("no_grad", "zero_grad", "nonfinite_grad")
    ]
    reader.close()


def test_a_layer_that_left_or_came_has_no_norm_not_a_nan(runtime_dir: Path) -> None:
    # The old head's column is NaN once it left, the new head's before it came: no norm at
    # all there, which the layers message says (gone, since), and tdbg dump leaves out rather
    # than writing "nan" (a non-finite gradient) for it.
    from tdbg.cli.dump import message_events

    messages = replaced_head_run(runtime_dir)
    layers = [m for m in messages if m["type"] == "layers"][-1]
    assert layers["names"] == ["0", "2", "2.0", "2.1"] and layers["gone"] == [1]
    # Step 3's gradients are read after the change is seen (the new optimizer is not hooked
    # until then): the new head has norms from step 3, the old one none from step 3.
    assert layers["since"] == [0, 0, 3, 3] and layers["gone_at"] == [3]
    after_welcome = [m for m in messages if m["type"] != "welcome"]  # as tdbg dump reads them
    events = list(message_events(after_welcome, {"type": "hello", "run": {}}))
    said = [e for e in events if e["type"] in ("hello", "layers") and "gone" in e][-1]
    assert said["gone"] == [1] and said["gone_at"] == [3] and said["since"] == [0, 0, 3, 3]
    norms = {e["step"]: e["grad_norms"] for e in events if e["type"] == "step"}
    assert sorted(norms) == list(range(6))
    for step in range(3):
        assert set(norms[step]) == {"0", "2"}
    for step in range(3, 6):
        assert set(norms[step]) == {"0", "2.0", "2.1"}
    assert not [v for row in norms.values() for v in row.values() if isinstance(v, str)]


def test_a_nan_of_a_layer_before_it_left_is_still_a_nan(runtime_dir: Path) -> None:
    # The layer that went NaN is the one a user replaces: its NaN before it left is its own.
    from tdbg.cli.dump import message_events
    from tdbg.model.run_state import RunState
    from tdbg.protocol.messages import read_layer_presence

    messages = replaced_head_run(runtime_dir, nan_grad_at=2)
    after_welcome = [m for m in messages if m["type"] != "welcome"]
    events = list(message_events(after_welcome, {"type": "hello", "run": {}}))
    norms = {e["step"]: e["grad_norms"] for e in events if e["type"] == "step"}
    assert norms[2]["2"] == "nan" and "2" not in norms[3]
    alerts = [m for m in messages if m["type"] == "alert" and m["kind"] == "nonfinite_grad"]
    assert alerts and alerts[0]["step"] == 2 and alerts[0]["layers"] == ["2"]
    state = RunState()
    layers = [m for m in messages if m["type"] == "layers"][-1]
    state.presence = read_layer_presence(layers, 4)
    rows = np.full((3, 4), np.nan, dtype=np.float32)
    absent = state.absent(np.array([2, 3, 4]), rows)
    assert absent[:, 1].tolist() == [False, True, True]  # its own NaN at 2; gone from 3
    assert absent[:, 2].tolist() == [True, False, False]  # the new head: none before 3


def test_a_model_added_before_the_first_step_has_norms_from_step_0(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    from tdbg.cli.dump import message_events

    torch.manual_seed(0)
    g, d = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    og, od = torch.optim.SGD(g.parameters(), lr=0.01), torch.optim.SGD(d.parameters(), lr=0.01)
    probe = tdbg.watch(g, og, grad_every=1)
    probe.add(d, od)
    x = torch.randn(8, 4)
    d.weight.register_hook(lambda grad: grad * float("nan"))  # d's gradient is NaN at step 0
    for opt in (og, od):
        opt.zero_grad()
    d(g(x)).mean().backward()
    og.step()
    od.step()
    probe.step()
    reader = probe_reader(probe)
    reader.wait(lambda r: len(r.records()) >= 1 and len(r.of("layers")) >= 1)
    reader.close()
    layers = reader.of("layers")[-1]
    assert not any(layers.get("since", ()))  # nothing came mid-run: d is there from step 0
    messages = [m for m in reader.messages if m["type"] != "welcome"]
    events = list(message_events(messages, {"type": "hello", "run": {}}))
    step0 = [e for e in events if e["type"] == "step"][0]
    assert step0["grad_norms"]["d"] == "nan"


def test_a_layer_with_its_own_optimizer_added_mid_step_keeps_every_row(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    # Step 3: the first optimizer's gradients are read (two layers) before the change is
    # seen, the new one's after it (three): one row of both, not a lost step.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    probe = tdbg.watch(model, opt, grad_every=1)
    opts = [opt]
    for step in range(6):
        if step == 3:
            model.add_module("extra", torch.nn.Linear(1, 1))
            opts.append(torch.optim.SGD(model.get_submodule("extra").parameters(), lr=0.05))
        for o in opts:
            o.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        for o in opts:
            o.step()
        probe.step(loss)
    reader = probe_reader(probe)
    reader.wait(lambda r: len(r.records()) >= 6)
    reader.close()
    records = reader.records()
    assert [r.step for r in records] == list(range(6))
    assert all(r.grad_norms is not None for r in records)
    assert records[3].grad_norms[2] > 0  # the new layer, in the joined row
    assert not [m for m in reader.of("probe") if m.get("errors")]


def test_a_new_head_s_own_optimizer_is_followed_with_the_backbone_frozen(
    runtime_dir: Path,
    probe_reader: OpenReader,
) -> None:
    # The new optimizer holds only the new head, which the probe had not read yet when that
    # optimizer first stepped: it was never asked again, and its learning rate never shown.

    def change(step: int, model: Any) -> torch.optim.Optimizer | None:
        if step != 4:
            return None
        model[2] = torch.nn.Linear(16, 1)
        model[0].requires_grad_(False)
        return torch.optim.Adam(model[2].parameters(), lr=1e-3)

    probe = changed_run(8, change)
    reader = probe_reader(probe)
    reader.wait(lambda r: len(r.records()) >= 8)
    reader.close()
    records = reader.records()
    assert [r.lr[-1] for r in records] == [0.05] * 4 + [1e-3] * 4
    kinds = {a["kind"] for a in reader.of("alert")}
    assert not kinds & {"zero_grad", "no_grad", "nonfinite_grad"}  # "0" is frozen now


def test_an_exploding_new_head_names_its_own_layers_not_the_gone_one(runtime_dir: Path) -> None:
    # lr 0.2 on the new head diverges: the gradient alert still fires across the change, and
    # names the largest norms there are (the gone layer's NaN is none of them).
    messages = replaced_head_run(runtime_dir, before=30, after=6)
    exploding = [m for m in messages if m["type"] == "alert" and m["kind"] == "exploding_grad"]
    assert exploding and all(m["step"] >= 30 for m in exploding)
    assert all("2" not in m["layers"] for m in exploding)


def test_clipping_without_an_optimizer_shows_the_same_pre_clip_norm(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    model = _model()
    x, y = _data()
    probe = tdbg.watch(model, grad_every=1)  # manual updates: gradients read at probe.step()
    reader = probe_reader(probe)
    returned = []
    for _ in range(3):
        model.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        returned.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                p.sub_(0.01 * p.grad)
        probe.step(loss)
    reader.wait(lambda r: len(r.records()) >= 3)
    for record, total in zip(reader.records(), returned, strict=True):
        assert total > 0.5 and record.grad_total == pytest.approx(total, rel=1e-5)
        assert record.clip_max == 0.5
    reader.close()


def test_a_closure_after_accumulated_micro_batches_counts_them_all(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    """Lightning with accumulate_grad_batches=k: k-1 backward passes outside the step, the last
    inside step(closure); the update's loss is all k of them."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    probe = tdbg.watch(model, opt, grad_every=1)
    reader = probe_reader(probe)
    k = 3
    parts: list[float] = []

    def micro(i: int) -> torch.Tensor:
        loss = ((model(x[i::k]) - y[i::k]) ** 2).mean() / k
        loss.backward()
        parts.append(loss.item())
        return loss

    opt.zero_grad()
    for i in range(k - 1):
        micro(i)
    opt.step(lambda: micro(k - 1))
    probe.step()
    reader.wait(lambda r: len(r.records()) >= 1)
    record = reader.records()[0]
    assert record.loss == pytest.approx(sum(parts), rel=1e-6)
    assert record.micro_batches == k
    reader.close()


def test_an_optimizer_wrapper_without_hooks_is_unwrapped(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    """Accelerate's AcceleratedOptimizer subclasses Optimizer but has no hook tables."""

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer  # no super().__init__(): as Accelerate does

        def step(self, closure=None):
            return self.optimizer.step(closure)

    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped = Wrapper(inner)
    x, y = _data()
    probe = tdbg.watch(model, wrapped, grad_every=1)
    reader = probe_reader(probe)
    for _ in range(2):
        inner.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        wrapped.step()
        probe.step(loss)
    reader.wait(lambda r: len(r.records()) >= 2)
    assert [r.lr for r in reader.records()] == [[0.05], [0.05]]
    assert all(r.grad_norms is not None for r in reader.records())
    reader.close()


def test_a_stall_alert_says_where_the_training_thread_is_stuck(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, probe_reader: OpenReader
) -> None:
    import threading

    from tdbg.probe import alerts
    from tdbg.protocol.stall import StallRule

    monkeypatch.setattr(alerts, "DEFAULT_STALL_RULE", StallRule(min_s=0.3, fast_cap_s=0.3))
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt)
    reader = probe_reader(probe)
    release = threading.Event()

    def next_batch_from_a_hung_loader() -> None:
        release.wait(30)

    def train() -> None:
        loop.run(10, probe)
        next_batch_from_a_hung_loader()
        loop.run(2, probe)

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        reader.wait(lambda r: any(a["kind"] == "stalled" for a in r.of("alert")))
    finally:
        release.set()
        trainer.join(10)
    stalled = next(a for a in reader.of("alert") if a["kind"] == "stalled")
    assert any("next_batch_from_a_hung_loader" in line for line in stalled["stack"][-3:])
    assert "stuck at" in stalled["message"]  # the prose keeps it, for people and old readers
    assert stalled["where"] and stalled["message"].endswith(stalled["where"])  # and a field
    assert "called from" in stalled["message"] and "test_real_loops.py" in stalled["message"]
    reader.wait(lambda r: any(a["kind"] == "resumed" for a in r.of("alert")))
    reader.close()


class Boom(torch.nn.Module):
    """A layer whose forward overflows float32 when armed (finite weights and inputs): to +-inf,
    which the Tanh after it absorbs (the loss stays finite), or, armed ``"nan"``, through a
    softmax of the overflowed values, whose NaN reaches the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(16))
        self.armed: bool | str = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.scale
        if self.armed == "nan":
            return torch.softmax(y * 1e30 * 1e30, -1)
        return y * 1e30 * 1e30 if self.armed else y


class InfBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class BadGrad(torch.nn.Module):
    """A layer whose backward makes Inf when armed; its forward (and the loss) stay finite."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(16))
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale
        return InfBackward.apply(x) if self.armed else x


class OriginNet(torch.nn.Sequential):
    """fc1, boom, bad, act, fc2 in a row, each reachable (and typed) by its name."""

    fc1: torch.nn.Linear
    boom: Boom
    bad: BadGrad
    act: torch.nn.Tanh
    fc2: torch.nn.Linear


def _origin_net() -> OriginNet:
    from collections import OrderedDict

    torch.manual_seed(0)
    return OriginNet(
        OrderedDict(
            fc1=torch.nn.Linear(4, 16),
            boom=Boom(),
            bad=BadGrad(),
            act=torch.nn.Tanh(),
            fc2=torch.nn.Linear(16, 1),
        )
    )


K = 6  # the step where it goes wrong: not a sampled step with grad_every=5


class _CalledWithKeywords(torch.nn.Module):
    """_origin_net called as Hugging Face models are: keywords only (``model(**batch)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _origin_net()

    def forward(self, *, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)


def _nan_run(
    scenario: str,
    grad_every: int | None,
    forward: bool | str = "nan",
    budget: float = 0.01,
    keywords: bool = False,
) -> tuple[Any, Reader, Callable[[int], None]]:
    """A probe on _origin_net and one training step as a function: at step K the scenario goes
    wrong once (one update spreads the NaN anyway). ``keywords``: the watched model is called
    with keyword arguments only."""
    net = _origin_net()
    outer = _CalledWithKeywords() if keywords else None
    if outer is not None:
        net = outer.net
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = _data()
    probe = tdbg.watch(outer or net, opt, grad_every=grad_every, overhead_budget=budget)
    # The inputs the re-run needs are captured by the probe's forward wrapper (no hook).
    assert "forward" in (outer or net).__dict__ and not (outer or net)._forward_pre_hooks
    reader = reader_on(probe)

    def train(step: int) -> None:
        if step == K:
            if scenario == "weights":
                with torch.no_grad():
                    net.fc2.weight[0, 0] = float("nan")
            elif scenario == "forward":
                net.boom.armed = forward
            else:
                net.bad.armed = True
        opt.zero_grad()
        out = net(x) if outer is None else outer(inputs=x)
        loss = ((out - y) ** 2).mean()
        loss.backward()
        opt.step()
        probe.step(loss)
        net.boom.armed = net.bad.armed = False

    return probe, reader, train


def _first_error(reader: Reader) -> dict[str, Any]:
    reader.wait(lambda r: any(a["kind"] == "nonfinite_origin" for a in r.of("alert")))
    alerts = reader.of("alert")
    first = next(a for a in alerts if a["severity"] == "error")
    assert first["kind"] == "nonfinite_origin", [(a["kind"], a["message"]) for a in alerts]
    return first


def _hunt_headline(reader: Reader, train: Callable[[int], None]) -> dict[str, Any]:
    """The automatic NaN hunt runs on the next steps, after NaN has spread everywhere; it heads
    its answer with the origin."""
    more = iter(range(20, 1000))

    def hunt_done() -> bool:
        train(next(more))
        return any(j["state"] == "done" for j in reader.of("job") if j["command"] == "nan_hunt")

    wait_until(hunt_done, 30.0, "the automatic NaN hunt's answer")
    hunt = next(j for j in reader.of("job") if j["command"] == "nan_hunt" and j["state"] == "done")
    return hunt["result"]


@pytest.mark.parametrize(
    ("grad_every", "budget"),
    [(1, 0.01), (5, 0.01), (None, 0.01), (None, 1e-6)],
    # auto-sparse: the adaptive interval on a budget so small that step K is never sampled,
    # whatever the machine's speed (on a loaded one the default budget may sample every step)
    ids=["every-step", "every-5", "auto", "auto-sparse"],
)
@pytest.mark.parametrize(
    ("scenario", "module", "phase"),
    [
        ("weights", "fc2", "weights"),
        ("forward", "boom", "forward"),
        ("backward", "bad", "backward"),
    ],
)
def test_the_first_alert_names_where_a_nan_began(
    runtime_dir: Path,
    scenario: str,
    module: str,
    phase: str,
    grad_every: int | None,
    budget: float,
) -> None:
    """Whether or not step K is a sampled step: on the CPU a non-finite loss forces that step's
    pass of weights and gradients, and an unmeasured update that left the weights non-finite
    is named from the next step's (the first alert and the hunt name K, not K+1)."""
    probe, reader, train = _nan_run(scenario, grad_every, budget=budget)
    for step in range(20):
        train(step)
    first = _first_error(reader)
    assert first["step"] == K and first["layers"] == [module], first["message"]
    assert phase in first["message"] or (phase == "weights" and "weights of" in first["message"])
    assert "with finite weights" not in first["message"]
    hunt = _hunt_headline(reader, train)
    assert (hunt["module"], hunt["step"], hunt["phase"]) == (module, K, phase), hunt
    reader.close()
    probe.close()


@pytest.mark.parametrize("grad_every", [1, 5], ids=["every-step", "every-5"])
def test_a_forward_overflow_in_a_model_called_with_keywords_is_named(
    runtime_dir: Path, grad_every: int
) -> None:
    """The forward re-run that names an overflowing module passes the forward's keyword
    arguments too (Hugging Face models take nothing else): the module and step K, sampled or
    forced."""
    probe, reader, train = _nan_run("forward", grad_every, keywords=True)
    for step in range(10):
        train(step)
    first = _first_error(reader)
    assert first["step"] == K and first["layers"] == ["net.boom"], first["message"]
    assert first["message"].startswith("forward of net.boom (Boom) made")
    reader.close()
    probe.close()


def test_an_overflow_the_loss_absorbs_is_named_by_its_step(runtime_dir: Path) -> None:
    """A forward overflow to inf that a Tanh absorbs leaves the loss finite: only gradients show
    it. Measured (grad_every=1), the forward re-run names the module; on a step that is not
    measured nothing cheap shows it at step K, and at K+1 the weights it reached are NaN: the
    alert names step K and the layer whose gradient it made non-finite, and says the gradients
    of step K were not measured (never a forward "with finite weights" it did not see)."""
    probe, reader, train = _nan_run("forward", 1, forward=True)
    for step in range(10):
        train(step)
    first = _first_error(reader)
    assert first["step"] == K and first["layers"] == ["boom"], first["message"]
    reader.close()
    probe.close()
    probe, reader, train = _nan_run("forward", 5, forward=True)
    for step in range(10):
        train(step)
    first = _first_error(reader)
    assert first["step"] == K and first["layers"] == ["bad"], first["message"]
    assert "not measured" in first["message"] and "finite weights" not in first["message"]
    reader.close()
    probe.close()


def test_next_forwards_run_early_under_accumulation_keep_every_micro_batch(
    runtime_dir: Path,
) -> None:
    """Each micro-batch's forward runs before the previous backward's step is told (the first
    one before ``probe.step()``): every backward follows a watched forward, so each is the
    update's, whatever side of ``probe.step()`` that forward ran on."""
    model, opt, x, probe, reader = _linear_run(0.01)
    expected = []
    loss = model(x).pow(2).mean()
    for _ in range(3):
        opt.zero_grad()
        total = 0.0
        for m in range(2):
            loss.backward()
            total += loss.item()
            loss = model(x * (m + 2)).pow(2).mean()  # the next micro-batch's, run early
        opt.step()
        probe.step()
        expected.append(total)
    records = _last_records(reader, probe, 3)
    assert [r.loss for r in records] == pytest.approx(expected, rel=1e-6)
    assert [r.micro_batches for r in records] == [2.0] * 3


def test_an_amp_skipped_update_shows_its_own_loss_not_one_aside(runtime_dir: Path) -> None:
    """GradScaler skips an update (inf gradients) after a backward aside from the model (an
    unrelated tensor, before the watched forward): the skipped step shows its own loss."""
    model, opt, x, probe, reader = _linear_run(0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    expected = []
    for step in range(3):
        if step >= 1:
            w = torch.ones(3, requires_grad=True)
            (w * 100).sum().backward()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        if step == 2:
            grad = model.get_parameter("weight").grad
            assert grad is not None
            grad[0, 0] = float("inf")  # the scaler skips this update
        scaler.step(opt)
        scaler.update()
        probe.step()
        expected.append(loss.item())
    reader.wait(lambda r: len(r.records()) >= 3)
    assert [r.loss for r in reader.records()[-3:]] == pytest.approx(expected, rel=1e-6)
    assert probe._sampler.amp_skipped_steps == 1
    reader.close()
    probe.close()


def test_a_backward_aside_that_raises_is_taken_back(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    """A backward aside from the model that raises (nothing in it requires grad) is taken
    back: a step with no other backward shows no loss, not the failed one's."""
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, grad_every=1)
    reader = probe_reader(probe)
    loop.step(probe)
    with pytest.raises(RuntimeError):
        torch.tensor(3.0).backward()
    loop.optimizer.step()
    probe.step()
    reader.wait(lambda r: len(r.records()) >= 2)
    last = reader.records()[-1]
    assert last.loss is None and last.micro_batches != 1.0, (last.loss, last.micro_batches)
    reader.close()
    probe.close()


def test_a_nan_loss_in_a_loop_that_runs_the_next_forward_early_names_its_step(
    runtime_dir: Path,
    probe_reader: OpenReader,
) -> None:
    """The next step's forward before ``probe.step()`` (each backward looks aside from the
    step, and is its loss all the same): a forward that overflows at step K to a NaN loss is
    still checked before its update: the first alert names step K and the module (its forward
    re-run before the update), not a bare NaN loss."""
    net = _origin_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = _data()
    probe = tdbg.watch(net, opt, grad_every=5)
    reader = probe_reader(probe)
    loss = ((net(x) - y) ** 2).mean()
    for step in range(K + 3):
        opt.zero_grad()
        loss.backward()
        opt.step()
        net.boom.armed = "nan" if step + 1 == K else False  # the forward of step K, run now
        loss = ((net(x) - y) ** 2).mean()
        probe.step()
    first = _first_error(reader)
    assert (first["step"], first["layers"]) == (K, ["boom"]), first["message"]
    reader.close()
    probe.close()


def test_a_weight_set_by_other_code_is_told_from_an_update(runtime_dir: Path) -> None:
    """Weights found non-finite after an unmeasured step: made by the update of that step
    (backward) unless code other than the optimizer wrote them (their version counters moved
    more than the update's): then the weights themselves, at the step that used them."""
    probe, reader, train = _nan_run("weights", 50)
    for step in range(10):
        train(step)
    first = _first_error(reader)
    assert first["step"] == K and first["layers"] == ["fc2"], first["message"]
    assert first["message"].startswith("weights of fc2 non-finite at step 6")
    reader.close()
    probe.close()


@pytest.mark.parametrize("grad_every", [1, 5])
def test_a_grad_scaler_skip_is_routine_and_a_later_nan_still_gets_its_origin(
    runtime_dir: Path, grad_every: int, probe_reader: OpenReader
) -> None:
    """AMP: at a high scale the scaled gradients overflow and GradScaler skips the update and
    lowers the scale — routine, not a NaN: no error, no origin, no hunt; the skip is counted.
    A NaN of the run's own later (a weight) still gets its origin, at its step."""
    net = _origin_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    x, y = _data()
    probe = tdbg.watch(net, opt, grad_every=grad_every)
    reader = probe_reader(probe)
    skip, nan_at = 3, 8
    for step in range(12):
        if step == nan_at:
            reader.wait(lambda r: len(r.records()) >= nan_at)
            reader.settle()
            assert not [a for a in reader.of("alert") if a["severity"] == "error"]
            assert not [j for j in reader.of("job") if j["command"] == "nan_hunt"]
            with torch.no_grad():
                net.fc2.weight[0, 0] = float("nan")
        opt.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        if step == skip:
            loss = loss * 1e34  # finite; scaled by 65536 it overflows: the scaler skips
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        probe.step()
        if step == skip:
            assert scaler.get_scale() == 2.0**15  # it did skip
    reader.wait(lambda r: any(a["kind"] == "nonfinite_origin" for a in r.of("alert")))
    reader.wait(lambda r: any(m.get("amp_skipped_steps", 0) >= 1 for m in r.of("probe")))
    alerts = reader.of("alert")
    errors = [a for a in alerts if a["severity"] == "error"]
    assert all(a["step"] >= nan_at for a in errors), errors
    first = errors[0]
    assert first["kind"] == "nonfinite_origin", errors
    assert (first["step"], first["layers"]) == (nan_at, ["fc2"]), first["message"]
    records = {r.step: r for r in reader.records()}
    assert records[skip].grad_norms is None and records[skip].clip_norm != records[skip].clip_norm
    assert records[skip].loss > 1e30  # the iteration's own (unscaled) loss
    reader.close()
    probe.close()


def test_the_hunt_headline_names_a_layer_of_the_second_model(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    """With several models the layers are named with their model's prefix ("netD.0"): the
    hunt's headline still says what module class it is (it was looked up in the first model,
    without the prefix, and came out None)."""
    netG, netD = _model(1), _origin_net()
    optG = torch.optim.SGD(netG.parameters(), lr=0.01)
    optD = torch.optim.SGD(netD.parameters(), lr=0.01)
    x, y = _data()
    probe = tdbg.watch([netG, netD], [optG, optD], grad_every=1)
    reader = probe_reader(probe)

    def train(step: int) -> None:
        if step == K:
            with torch.no_grad():
                netD.fc2.weight[0, 0] = float("nan")
        for net, opt in ((netG, optG), (netD, optD)):
            opt.zero_grad()
            ((net(x) - y) ** 2).mean().backward()
            opt.step()
        probe.step()

    for step in range(K + 2):
        train(step)
    first = _first_error(reader)
    assert (first["step"], first["layers"]) == (K, ["netD.fc2"]), first["message"]
    hunt = _hunt_headline(reader, train)
    assert (hunt["module"], hunt["module_type"], hunt["step"]) == ("netD.fc2", "Linear", K)
    reader.close()
    probe.close()


def test_skip_nonfinite_keeps_the_model_intact_and_names_the_origin(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    net = _origin_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = _data()
    probe = tdbg.watch(net, opt, grad_every=1, skip_nonfinite=True)
    reader = probe_reader(probe)
    for step in range(8):
        net.boom.armed = step == 4
        if step == 4:
            before = {n: p.detach().clone() for n, p in net.named_parameters()}
        opt.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        probe.step(loss)
        if step == 4:
            assert all(torch.equal(before[n], p) for n, p in net.named_parameters())
    assert all(torch.isfinite(p).all() for p in net.parameters())  # trained on, intact
    reader.wait(lambda r: any(a["kind"] == "skipped_nonfinite" for a in r.of("alert")))
    reader.wait(lambda r: any(m.get("skipped_steps") == 1 for m in r.of("probe")))
    origin = next(a for a in reader.of("alert") if a["kind"] == "nonfinite_origin")
    assert origin["step"] == 4 and origin["layers"] == ["boom"]
    reader.close()


def test_each_skipped_update_s_alert_counts_the_skips_up_to_it(
    runtime_dir: Path, probe_reader: OpenReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Skipped updates resolved by the probe thread in one go (a fast loop: many steps a tick)
    each say how many were skipped up to and including their own step, not the count when the
    probe thread got to them (every alert said "5 update(s) skipped so far" before)."""
    net = _origin_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = _data()
    probe = tdbg.watch(net, opt, grad_every=1, skip_nonfinite=True)
    reader = probe_reader(probe)
    hold = threading.Event()
    tick = faults.original(probe, "server_tick")

    def held_tick(now: float) -> None:  # the probe thread resolves nothing until released
        hold.wait(TIMEOUT)
        tick(now)

    inject_fault(monkeypatch, probe, "server_tick", held_tick)
    skipped_at = [3, 4, 6, 7, 8]
    for step in range(10):
        net.boom.armed = step in skipped_at
        opt.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        probe.step(loss)
    hold.set()
    reader.wait(lambda r: sum(a["kind"] == "skipped_nonfinite" for a in r.of("alert")) == 5)
    skips = [a for a in reader.of("alert") if a["kind"] == "skipped_nonfinite"]
    assert [a["step"] for a in skips] == skipped_at
    for count, alert in enumerate(skips, start=1):
        assert f"({count} update(s) skipped so far;" in alert["message"], alert["message"]
    reader.close()
    probe.close()


def _last_records(reader: Reader, probe: Any, n: int) -> list[Any]:
    """The last ``n`` step records once the client has them; the client and probe closed."""
    reader.wait(lambda r: len(r.records()) >= n)
    records = reader.records()[-n:]
    reader.close()
    probe.close()
    return records


def _linear_run(lr: float) -> tuple[torch.nn.Module, Any, torch.Tensor, Any, Reader]:
    """A one-layer model, its SGD, a batch, a probe sampling every step and a client."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.randn(8, 4)
    probe = tdbg.watch(model, opt, grad_every=1)
    return model, opt, x, probe, reader_on(probe)


@pytest.mark.parametrize("aside", ["copy", "unrelated"])
def test_a_backward_aside_from_the_watched_model_is_not_the_step_s_loss(
    runtime_dir: Path, aside: str
) -> None:
    """A scalar backpropagated between steps that no watched forward made (a deep copy of the
    model trained aside, as an EMA or snapshot check does; an unrelated tensor) is not summed
    into the next step's loss or micro-batches (it was: 0.15991 for 0.07996, micro-batches 2).
    """
    model, opt, x, probe, reader = _linear_run(0.1)
    losses = []
    for step in range(4):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step()
        losses.append(loss.item())
        if step == 1:
            if aside == "copy":
                copy.deepcopy(model)(x).pow(2).mean().backward()
            else:
                w = torch.ones(3, requires_grad=True)
                (w * 2).sum().backward()
    records = _last_records(reader, probe, 4)
    assert [r.loss for r in records] == pytest.approx(losses, rel=1e-6)
    assert [r.micro_batches for r in records] == [1.0] * 4


def test_a_loop_that_runs_the_next_forward_before_probe_step_keeps_its_losses(
    runtime_dir: Path,
) -> None:
    """The next step's forward before ``probe.step()``: no watched forward falls between two
    steps, so each backward looks aside; with no other backward in the step it is the step's
    loss all the same (one micro-batch)."""
    model, opt, x, probe, reader = _linear_run(0.1)
    losses = []
    loss = model(x).pow(2).mean()
    for _ in range(5):
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        loss = model(x).pow(2).mean()  # the next step's, before this step is told
        probe.step()
    records = _last_records(reader, probe, 5)
    assert [r.loss for r in records] == pytest.approx(losses, rel=1e-6)
    assert [r.micro_batches for r in records] == [1.0] * 5


def test_total_steps_come_from_a_one_cycle_schedule(runtime_dir: Path) -> None:
    loop = Loop()
    schedule = torch.optim.lr_scheduler.OneCycleLR(loop.opt, max_lr=0.1, total_steps=500)  # type: ignore[arg-type]
    probe = tdbg.watch(loop.model, loop.opt)
    wait_until(lambda: probe.total_steps == 500, what="the schedule's length")
    probe.close()
    assert tdbg.watch(loop.model, loop.opt, total_steps=7).total_steps == 7  # given wins
    del schedule
