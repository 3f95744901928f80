"""The documentation site against the code: every flag of every command is in the command
reference, every inventory key in the inventory reference (and no key the models lack), the
README stays a README, and the README's and the changelog's links lead to files that exist.
(Links between the site's own pages are checked by `mkdocs build --strict`, which scripts/test
runs before the tests.)"""

import re

import click
import pytest
import yaml
from pydantic import BaseModel

from orchestrator.cli import cli
from orchestrator.inventory.models import InventoryModel
from tests.documents import DOCS, ROOT

COMMANDS_PAGE = DOCS / "reference" / "commands.md"
INVENTORY_PAGE = DOCS / "inventory.md"
COMMON = "Options of every node-facing command"


# ---------------------------------------------------------------- every flag in the reference
def commands(group: click.Group = cli, prefix: str = "") -> dict[str, click.Command]:
    """'exec', 'render slurm', 'inventory check', ...: every command a user can type."""
    ctx = click.Context(group)
    out = {}
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if isinstance(cmd, click.Group):
            out.update(commands(cmd, f"{prefix}{name} "))
        else:
            out[f"{prefix}{name}"] = cmd
    return out


def long_flags(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts
            if o.startswith("--") and o != "--help"}


def sections(text: str) -> dict[str, str]:
    """The page's `## heading` -> its text."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def undocumented(page: str, cmds: dict[str, click.Command], common: set[str]) -> list[str]:
    """'COMMAND --flag' for every flag the page's section for COMMAND (or, for the options every
    node-facing command shares, its common section) does not name."""
    secs = sections(page)
    shared = secs.get(COMMON, "")
    missing = []
    for name, cmd in sorted(cmds.items()):
        own = secs.get(name)
        if own is None:
            missing.append(f"{name} (no '## {name}' section)")
            continue
        for flag in sorted(long_flags(cmd)):
            if not re.search(re.escape(flag) + r"(?![\w-])", own if flag not in common else own + shared):
                missing.append(f"{name} {flag}")
    return missing


def common_flags(cmds: dict[str, click.Command]) -> set[str]:
    return set.intersection(*(long_flags(cmds[c]) for c in ("exec", "preflight", "train", "top")))


def test_every_flag_of_every_command_is_in_the_reference():
    cmds = commands()
    assert {"exec", "train", "render k8s", "inventory from-slurm", "health"} <= set(cmds)
    assert sum(len(long_flags(c)) for c in cmds.values()) > 150
    missing = undocumented(COMMANDS_PAGE.read_text(), cmds, common_flags(cmds))
    assert not missing, f"flags missing from {COMMANDS_PAGE.relative_to(ROOT)}:\n" + "\n".join(missing)


def test_the_flag_check_is_not_vacuous():
    cmds = commands()
    page = COMMANDS_PAGE.read_text()
    assert undocumented(page.replace("--hang-timeout", "--hang-limit"), cmds, common_flags(cmds)) == \
        ["drill --hang-timeout", "train --hang-timeout"]
    assert undocumented(page.replace("--fanout", "--fan"), cmds, common_flags(cmds))  # the common section counts
    assert "stack (no '## stack' section)" in undocumented(page.replace("## stack", "## stacks"), cmds,
                                                           common_flags(cmds))


# ---------------------------------------------------------------- every inventory key in the reference
def _models_in(annotation) -> list[tuple[type[BaseModel], bool]]:
    """(model, in a list) for each model an annotation holds: X, X | None, list[X]."""
    if getattr(annotation, "__origin__", None) is list:
        return [(m, True) for m, _ in _models_in(annotation.__args__[0])]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, False)]
    return [m for a in getattr(annotation, "__args__", ()) for m in _models_in(a)]


def model_keys(model: type[BaseModel], prefix: str = "", walked: set | None = None) -> set[str]:
    """'ssh.user', 'nodes[].gpus', 'train.on_hang', ...: every key the inventory models take. A
    model met a second time (a node's ssh: is the top ssh:) is named, not walked again."""
    walked = {model} if walked is None else walked
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(prefix + name)
        for sub, in_list in _models_in(field.annotation):
            if sub not in walked:
                walked.add(sub)
                keys |= model_keys(sub, f"{prefix}{name}{'[]' if in_list else ''}.", walked)
    return keys


def doc_keys(doc: dict, top: bool = True) -> set[str]:
    """The same paths for the keys a YAML document shows; `env:` maps hold the user's names, and a
    node's `ssh:` is the top one's (named, not walked), as in model_keys."""
    keys = set()
    for k, v in doc.items():
        keys.add(k)
        if isinstance(v, dict) and k != "env" and (top or k != "ssh"):
            keys |= {f"{k}.{sub}" for sub in doc_keys(v, top)}
        elif isinstance(v, list) and all(isinstance(i, dict) for i in v):
            keys |= {f"{k}[].{sub}" for item in v for sub in doc_keys(item, top=False)}
    return keys


def reference_yaml(text: str) -> dict:
    block = re.search(r"^## Every key\n.*?```yaml\n(.*?)```", text, re.S | re.M)
    assert block, "the inventory page's '## Every key' block was not found"
    return yaml.safe_load(block.group(1))


def test_every_inventory_key_is_in_the_reference_and_no_other():
    model = model_keys(InventoryModel)
    assert {"ssh.proxy_jump", "nodes[].spare", "nodes[].ssh", "train.checkpoint_replica", "setup.clusterctl"} <= model
    doc = doc_keys(reference_yaml(INVENTORY_PAGE.read_text()))
    assert sorted(model - doc) == [], "inventory keys the reference does not show"
    assert sorted(doc - model) == [], "keys the reference shows that the inventory does not take"


def test_the_key_check_is_not_vacuous():
    doc = doc_keys(reference_yaml(INVENTORY_PAGE.read_text().replace("  gpu_diag:", "  gpu_diagnostics:")))
    model = model_keys(InventoryModel)
    assert model - doc == {"checks.gpu_diag"} and doc - model == {"checks.gpu_diagnostics"}


# ---------------------------------------------------------------- a README that is a README
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def relative_links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t)]


def test_the_readme_is_short_and_keeps_the_two_set_up_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move the detail into docs/"
    # tests and CI run them exactly so (.ci/run, tests/test_demo.py)
    assert "scripts/demo" in lines and "scripts/test" in lines


@pytest.mark.parametrize("name", ["README.md", "CHANGELOG.md"])
def test_links_outside_the_site_lead_to_files(name):
    doc = ROOT / name
    links = relative_links(doc.read_text())
    assert len(links) >= (15 if name == "README.md" else 1)
    missing = [t for t in links if not (doc.parent / t).exists()]
    assert not missing, f"{name} links to files that do not exist: {missing}"


def test_the_link_check_is_not_vacuous():
    assert relative_links("[a](docs/x.md#y) [b](https://e.org) [c](CHANGELOG.md)") == ["docs/x.md", "CHANGELOG.md"]
