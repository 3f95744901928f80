"""The smaller things issue 30 found a new user tripping over (its item 9), each held by a test:
`inventory check` gives a spare no rank, a missing identity file is the inventory's error (file:line,
exit 2) for every command that connects, and `plan -i` takes the inventory's precision."""

import json
from pathlib import Path

import jsonschema
import yaml

from orchestrator.cli import main

SCHEMAS = Path(__file__).resolve().parent.parent / "orchestrator" / "schemas"


def write(tmp_path, doc, name="nodes.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(p)


def local_nodes(n, spare_at=()):
    return [{"name": f"n{i + 1}", "connection": "local", "gpus": 0, **({"spare": True} if i in spare_at else {})}
            for i in range(n)]


def test_inventory_check_gives_a_spare_no_rank(tmp_path, capsys):
    path = write(tmp_path, {"nodes": local_nodes(4, spare_at=(1,))})
    assert main(["inventory", "check", "--json", "-i", path]) == 0
    doc = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, json.loads((SCHEMAS / "inventory-check.json").read_text()))
    assert [(n["name"], n["rank"], n["spare"]) for n in doc["nodes"]] == [
        ("n1", 0, False), ("n2", None, True), ("n3", 1, False), ("n4", 2, False)]
    assert main(["inventory", "check", "-i", path]) == 0
    out = capsys.readouterr().out
    assert "3 nodes + 1 spare" in " ".join(out.split())  # the title may wrap
    row = next(ln for ln in out.splitlines() if " n2 " in ln)
    assert "spare" in row and not any(f" {r} " in row.split("n2")[0] for r in "0123")


def test_a_missing_identity_file_is_the_inventorys_error_with_its_line_before_any_connection(tmp_path, capsys):
    doc = {"ssh": {"user": "train", "identity_file": str(tmp_path / "no-such-key")},
           "nodes": [{"name": "gpu1", "host": "192.0.2.1"}, {"name": "gpu2", "host": "192.0.2.2"}]}
    path = write(tmp_path, doc)
    for argv in (["exec", "--", "true"], ["preflight"], ["train", "--skip-preflight"], ["sync"]):
        assert main([*argv, "-i", path] if argv[0] != "exec" else ["exec", "-i", path, "--", "true"]) == 2, argv
        err = capsys.readouterr().err
        assert f"{path}:3: ssh.identity_file '{tmp_path / 'no-such-key'}' does not exist on this machine (used by " \
               "gpu1, gpu2)" in " ".join(err.split()), (argv, err)
        assert "Traceback" not in err
    assert main(["inventory", "check", "-i", path]) == 0  # the document is valid; the key is this machine's


def plan_doc(capsys, *args):
    assert main(["plan", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_i_takes_the_precision_and_comm_hook_the_trainer_will_run_with(tmp_path, capsys):
    nodes = [{"name": "a", "host": "10.0.0.1"}, {"name": "b", "host": "10.0.0.2"}]
    bf16 = write(tmp_path, {"nodes": nodes, "train": {"args": ["--preset", "nano", "--precision=bf16",
                                                              "--comm-hook", "bf16"]}}, "bf16.yaml")
    got = plan_doc(capsys, "-i", bf16)
    assert (got["precision"], got["hook"]) == ("bf16", "bf16")
    assert got["sync_bytes"] == plan_doc(capsys, "--preset", "nano", "--comm-hook", "bf16")["sync_bytes"]
    assert plan_doc(capsys, "-i", bf16, "--precision", "fp16")["precision"] == "fp16"  # the flag wins
    plain = write(tmp_path, {"nodes": nodes, "train": {"args": ["--preset", "nano"]}}, "plain.yaml")
    assert plan_doc(capsys, "-i", plain)["precision"] == "fp32"  # the trainer's own default, not fp16
    script = write(tmp_path, {"nodes": nodes, "train": {"script": "train.py"}}, "script.yaml")
    assert plan_doc(capsys, "-i", script)["precision"] == "fp16"  # not the trainer: plan's default
    assert plan_doc(capsys)["precision"] == "fp16"
