"""One owner of the parallelism (issue 53): the Trainer builds its whole state in ``__init__`` (no builder
methods ``train()`` must call in order), and neither it nor the other packages that train, evaluate or predict
branch on the strategy or import a strategy's mechanics: :mod:`sfm.distributed.parallelize` decides."""

from __future__ import annotations

import ast
from pathlib import Path

SFM = Path(__file__).resolve().parents[2] / "sfm"
# the counters the loop advances (first set in __init__): the step, the step an attempt started from, the batch
COUNTERS = {"step", "start_step", "batch"}


def trainer_class() -> ast.ClassDef:
    tree = ast.parse((SFM / "train" / "trainer.py").read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")


def self_attributes_set(node: ast.AST) -> set[str]:
    """The names ``X`` of every ``self.X = ...`` (also in tuples, ``+=`` and annotated) under ``node``, and of
    ``setattr(self, "X", ...)``."""
    names: set[str] = set()

    def targets(t: ast.AST):
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from targets(e)
        elif isinstance(t, ast.Starred):
            yield from targets(t.value)
        else:
            yield t

    for n in ast.walk(node):
        found = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
            n, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)) else []
        for t in (t for target in found for t in targets(target)):
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr" and n.args \
                and isinstance(n.args[0], ast.Name) and n.args[0].id == "self":
            names.add(ast.unparse(n.args[1]))
    return names


def test_the_trainer_sets_its_attributes_in_init_only_but_the_counters_the_loop_advances():
    methods = {m.name: m for m in trainer_class().body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
    in_init = self_attributes_set(methods["__init__"])
    elsewhere = {f"{name}: self.{attr}" for name, m in methods.items() if name != "__init__"
                 for attr in self_attributes_set(m) - COUNTERS}
    assert not elsewhere, sorted(elsewhere)
    assert COUNTERS <= in_init, COUNTERS - in_init
    assert {"model", "checkpointer", "train_step", "stream", "metrics"} <= in_init, in_init


def test_the_attribute_check_sees_every_way_of_setting_one():
    method = ast.parse("def f(self):\n"
                       "    self.a = 1\n    self.b, (self.c, *self.d) = x\n    self.e += 1\n    self.f: int = 2\n"
                       "    setattr(self, 'g', 3)\n    self.h.i = 4\n    other.j = 5\n")
    assert self_attributes_set(method) == {"a", "b", "c", "d", "e", "f", "'g'"}


# what names a strategy in a condition, and the modules that build one
STRATEGY_WORDS = ("strategy", "deepspeed", "fsdp", "ddp")
MECHANICS = ("sfm.distributed.strategies", "sfm.distributed.deepspeed_zero", "sfm.distributed.context_parallel",
             "deepspeed", "torch.distributed.fsdp", "torch.nn.parallel")
# the packages that train, fine-tune, evaluate and predict with a model: they ask sfm.distributed.parallelize
USERS = ("train", "finetune", "eval", "predict")


def test_no_package_that_trains_branches_on_the_strategy_or_builds_one():
    conditions, imports = [], []
    for path in sorted(p for package in USERS for p in (SFM / package).rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            test = node.test if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)) else \
                node.ifs[0] if isinstance(node, ast.comprehension) and node.ifs else \
                node if isinstance(node, ast.Match) else None
            source = ast.unparse(test.subject if isinstance(test, ast.Match) else test) if test is not None else ""
            if any(word in source.lower() for word in STRATEGY_WORDS):
                conditions.append(f"{path.relative_to(SFM)}:{node.lineno}: {source}")
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module == "sfm.distributed":
                modules = [f"sfm.distributed.{a.name}" for a in node.names]
            imports += [f"{path.relative_to(SFM)}:{node.lineno}: {m}" for m in modules
                        if any(m == x or m.startswith(x + ".") for x in MECHANICS)]
    assert not conditions and not imports, (conditions, imports)
