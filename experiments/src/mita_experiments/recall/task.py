"""The recall task on the shared trainer (:mod:`mita_experiments.trainer`): data as a ``TaskData``
of per-token labels, the LRA encoder as a token classifier, its configuration, training and
evaluation of a checkpoint.

Token ids are shifted by one for the encoder (0 is its padding id, and its embedding is
zero): filler 0 becomes 1, a one-hop query's empty value channel stays 0 and adds nothing.
Labels are value - V/2 at query positions and ``IGNORE`` elsewhere; the model is the LRA
encoder with ``pooling="none"`` (a token classifier).

``data.train_lengths`` (default ``[]``: off) makes the training split a length mixture
(``data.generate_mix``): equal shares at each shorter N_i (P_i = min(P, N_i // 4)), padded and
masked, and at N itself; validation and test stay at (N, P). With no positions, the model is
the same at every length, so what it learns on the short sequences (where the value signal is
less diluted by filler) carries over to N.

``data.diagnostics`` (default false) adds MiTA's routing diagnostics (:mod:`.diagnostics`,
per layer and head) to every validation and test evaluation of a MiTA model: columns
``{metric}_l{layer}h{head}`` of metrics.csv / TensorBoard (NaN on the training rows, where
they are not measured).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from .. import trainer
from ..lra import train as lra_train
from ..lra.config import load_config
from ..lra.data.loaders import Split, TaskData
from ..utils.distributed import Dist, init_distributed
from . import data as gen
from . import diagnostics as diag
from . import routing

DATA_KEYS = ("seq_len", "num_pairs", "vocab_size", "form")
#: config keys a resumed run may change besides the trainer's
FREE_KEYS = ("source",)


def config(variant: str = "cpu", overrides: list[str] | None = None, path: str | Path | None = None) -> dict[str, Any]:
    """The recall configuration (``configs/recall.json``, or the JSON file ``path``) with
    ``section.key=value`` overrides, checked (:func:`check_data` and the LRA config's checks)."""
    path = path or resources.files("mita_experiments.recall") / "configs" / "recall.json"
    cfg = load_config("recall", variant, overrides, Path(str(path)))
    check_data(cfg["data"])
    return cfg


def _whole(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_data(data_config: Mapping[str, Any]) -> None:
    """A ValueError for a bad value of the data section: seq_len, num_pairs, vocab_size,
    num_train, num_val, num_test whole numbers >= 1, seed >= 0, the spec's own rules
    (:class:`~.data.RecallSpec`) and train_lengths (a list of shorter lengths)."""
    for key, low in (("seq_len", 1), ("num_pairs", 1), ("vocab_size", 1), ("num_train", 1), ("num_val", 1)):
        if not _whole(data_config.get(key), low):
            raise ValueError(f"data.{key} must be a whole number >= {low}, got {data_config.get(key)!r}")
    for key, low in (("num_test", 1), ("seed", 0)):
        if not _whole(data_config.get(key), low):
            raise ValueError(f"data.{key} must be a whole number >= {low}, got {data_config.get(key)!r}")
    if not isinstance(data_config.get("diagnostics", False), bool):
        raise ValueError(f"data.diagnostics must be true or false, got {data_config.get('diagnostics')!r}")
    lengths = data_config.get("train_lengths") or []
    if not (isinstance(lengths, (list, tuple)) and all(_whole(n, 1) for n in lengths)):
        raise ValueError(f"data.train_lengths must be a list of whole numbers, got {lengths!r}")
    gen.mix_specs(spec_of(data_config), list(lengths))


def spec_of(data_config: Mapping[str, Any]) -> gen.RecallSpec:
    """The ``RecallSpec`` of a configuration's data section; a ValueError names a bad value."""
    try:
        return gen.RecallSpec(**{k: data_config[k] for k in DATA_KEYS if k in data_config})
    except (TypeError, ValueError) as err:
        raise ValueError(f"data: {err}") from None


def _split(
    spec: gen.RecallSpec, tokens: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor | None = None
) -> Split:
    ids = tokens.to(torch.int16) + 1  # filler 0 -> 1; gen.PAD (-1) -> 0, the encoder's padding
    if spec.form == "onehop":
        ids[..., 1] = torch.where(tokens[..., 1] == 0, 0, ids[..., 1])
    labels = torch.where(targets == gen.IGNORE, gen.IGNORE, targets - spec.vocab_size // 2).to(torch.int16)
    if lengths is None:
        lengths = torch.full((len(ids),), spec.seq_len, dtype=torch.long)
    return Split(ids, lengths, labels)


def task_data(data_config: dict[str, Any], root: str | Path | None = None) -> TaskData:
    """The splits of a configuration's data section, generated (seeded by ``data.seed``) or read
    from ``root`` (the output of ``mita recall generate``); ``data.train_lengths`` (generated
    data only) makes the training split a length mixture."""
    mix = list(data_config.get("train_lengths") or [])
    if mix and root is not None:
        raise ValueError("data.train_lengths mixes lengths into generated data; with --data, set it to []")
    if root is not None:
        spec, raw = gen.load(root)
    else:
        spec = spec_of(data_config)
        seeds = gen.split_seeds(int(data_config["seed"]))
        sizes = {name: int(data_config[f"num_{name}"]) for name in gen.SPLITS}
        raw = {
            name: gen.generate_mix(spec, mix, sizes[name], seeds[name])
            if mix and name == "train"
            else gen.generate(spec, sizes[name], seeds[name])
            for name in gen.SPLITS
        }
    missing = [s for s in gen.SPLITS if s not in raw]
    if missing:
        raise ValueError(f"recall data at {root} lacks the split(s) {missing}")
    splits = {name: _split(spec, *raw[name]) for name in gen.SPLITS}
    return TaskData(splits, vocab_size=spec.vocab_size + 1, num_classes=spec.num_classes, max_length=spec.seq_len)


def build_model(config: Mapping[str, Any], meta: Mapping[str, Any], attention: Any) -> torch.nn.Module:
    """The LRA encoder of the config's model section for ``meta`` (``pooling="none"``: a token
    classifier; :func:`mita_experiments.lra.train.build_model`), where ``attention`` may also be the
    study's ``mita_recall`` (:mod:`.routing`)."""
    with routing.registered():
        return lra_train.build_model(config, meta, attention)


def scores(
    model: torch.nn.Module, batch: tuple[list[torch.Tensor], torch.Tensor], diagnostics: bool = False
) -> trainer.Scores:
    """Summed cross-entropy and number correct over the query positions of a batch; with
    ``diagnostics``, also the routing diagnostics of the model's MiTA layers as sums over the
    query positions (:func:`~.diagnostics.diagnostic_scores`), measured in evaluation mode only
    (NaN in training)."""
    inputs, labels = batch
    ids = [t.long() for t in inputs]
    if not diagnostics:
        return trainer.classification_scores(model(*ids), labels.long(), gen.IGNORE)
    if model.training:
        s = trainer.classification_scores(model(*ids), labels.long(), gen.IGNORE)
        s.metrics.update(dict.fromkeys(diag.model_metric_names(model), float("nan")))
        return s
    with diag.RoutingProbe(model) as probe:
        logits = model(*ids)
    s = trainer.classification_scores(logits, labels.long(), gen.IGNORE)
    query = labels.long() != gen.IGNORE
    targets = diag.target_keys(ids[0][..., 0] if ids[0].dim() == 3 else ids[0], query)
    s.metrics.update(diag.diagnostic_scores(probe.captures, targets))
    return s


def diagnostic_metrics(config: Mapping[str, Any], attention: Any) -> tuple[str, ...]:
    """The diagnostics' metric names of a run (empty unless ``data.diagnostics`` is on); a
    ValueError if it is on and the attention is not MiTA."""
    if not config["data"].get("diagnostics"):
        return ()
    from mita.attention import resolve
    from mita.layers.mita import MiTAAttention

    with routing.registered():
        method, _ = resolve(attention or "sdpa")
    if not (isinstance(method.layer, type) and issubclass(method.layer, MiTAAttention)):
        raise ValueError(f"data.diagnostics=True needs a MiTA attention (mita, mita_routed, ...), got {attention!r}")
    return diag.metric_names(config["model"]["depth"], config["model"]["num_heads"])


def recall_task(config: Mapping[str, Any], data: TaskData, attention: Any) -> trainer.Task:
    """The trainer's task of recall: the token classifier with ``attention`` on ``data``."""
    names = diagnostic_metrics(config, attention)
    return trainer.Task(
        build_model=lambda: build_model(config, data.meta, attention),
        scores=functools.partial(scores, diagnostics=bool(names)),
        metrics=("accuracy", *names),
        train_data=data.splits["train"],
        eval_data={"val": data.splits["val"], "test": data.splits["test"]},
        identity={"attention": attention},
        fingerprint=data.fingerprint(),
        free_keys=FREE_KEYS,
        name=f"recall {attention}",
    )


def train(
    config: Mapping[str, Any], data: TaskData, run_dir: str | Path, attention: Any = None, **options: Any
) -> dict[str, Any]:
    """Train (or resume) a recall run in ``run_dir``; returns its summary.

    Args:
        config: the recall configuration (:func:`config`).
        data: its data (:func:`task_data`).
        run_dir: the run folder (see :mod:`mita_experiments.trainer`).
        attention: a registered attention or config; default: on resume the run's own, else
            "sdpa"; another one than the run's is refused on resume.
        options: the keyword arguments of :func:`mita_experiments.trainer.train`.
    """
    attention = trainer.run_attention(run_dir, attention, bool(options.get("resume")))
    return trainer.train(recall_task(config, data, attention), config, run_dir, **options)


def evaluate_checkpoint(
    path: str | Path,
    data: TaskData | str | Path | None = None,
    attention: Any = None,
    options: dict[str, Any] | None = None,
    split: str = "test",
    batch_size: int | None = None,
    ctx: Dist | None = None,
    diagnostics: bool = False,
) -> dict[str, Any]:
    """Loss, accuracy and throughput of a recall checkpoint on ``split``, optionally with another
    attention or call-time options (MiTA's num_landmarks, topk, num_routed), and with
    ``diagnostics`` the routing diagnostics of its MiTA layers (means per query position under
    ``"diagnostics"``: :mod:`.diagnostics`).

    Args:
        path: a run folder (its best.pt, else checkpoint.pt), a .pt or a model.safetensors.
        data: the recall data, or a folder written by ``mita recall generate`` (default: the
            run's own data, generated from its config); its vocabulary and length must be the run's.
        attention: evaluate with this attention (default: the trained one).
        options: call-time attention options (default none).
        split: "train", "val" or "test" (default "test").
        batch_size: sequences per forward (default: the run's eval batch size).
        ctx: this process's place in a DDP run (default: :func:`init_distributed`).
        diagnostics: also measure the routing diagnostics (a MiTA attention only; default False).
    """
    path = trainer.resolve_checkpoint(path)
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if not isinstance(data, TaskData):
        run_data = trainer.read_checkpoint(path)["config"]["data"]
        data = task_data({**run_data, "train_lengths": []} if data else run_data, data)
    ctx = ctx or init_distributed()
    sums: dict[str, float] = {}
    queries = [0.0]

    def score(model: torch.nn.Module, batch: tuple[list[torch.Tensor], torch.Tensor]) -> trainer.Scores:
        s = scores(model, batch, diagnostics)
        for name in [n for n in s.metrics if n != "accuracy"]:  # the trainer's evaluate reports accuracy only
            sums[name] = sums.get(name, 0.0) + float(s.metrics.pop(name))
        queries[0] += float(s.count)
        return s

    result = lra_train.evaluate_checkpoint(
        path, data, attention, options, split, batch_size, ctx, build=build_model, score=score
    )
    if diagnostics:
        totals = ctx.all_sum([*sums.values(), queries[0]])
        result["diagnostics"] = {name: total / max(totals[-1], 1.0) for name, total in zip(sums, totals)}
    return result
