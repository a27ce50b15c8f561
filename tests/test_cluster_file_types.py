"""Every key of every table of a cluster file, given every TOML type: either a value the key takes,
or one clear line naming the key (ConfigError) — never a traceback out of `dloco up`."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from dloco.cluster import config as cluster_config
from dloco.cluster.config import _RUN_TYPES, _SECTIONS, DEFAULT_PROFILE, Region
from dloco.protocol.errors import ConfigError

# one value of each TOML type, as TOML text
VALUES = {
    "string": '"abc"',
    "int": "7",
    "float": "0.5",
    "bool": "true",
    "array": "[1, 2]",
    "table": "{ a = 1 }",
}
PROFILE = DEFAULT_PROFILE.read_text()


def _with(section: str, key: str, value: str) -> str:
    """The shipped profile with `key = value` in its first [section] (or first [[regions]])."""
    header = "[[regions]]\n" if section == "regions" else f"[{section}]\n"
    if header not in PROFILE:
        return PROFILE + f"\n{header}{key} = {value}\n"
    start = PROFILE.index(header) + len(header)
    end = PROFILE.find("\n[", start)
    end = len(PROFILE) if end < 0 else end
    lines = [line for line in PROFILE[start:end].split("\n") if line.split("=")[0].strip() != key]
    return PROFILE[:start] + f"{key} = {value}\n" + "\n".join(lines) + PROFILE[end:]


CASES = [
    (section, key, kind)
    for section, keys in sorted(_SECTIONS.items())
    for key in sorted(keys)
    for kind in VALUES
] + [("regions", field.name, kind) for field in dataclasses.fields(Region) for kind in VALUES]


@pytest.mark.parametrize(("section", "key", "kind"), CASES)
def test_a_wrong_type_is_one_line_naming_the_key(tmp_path, section, key, kind):
    path = tmp_path / "cluster.toml"
    path.write_text(_with(section, key, VALUES[kind]))
    assert tomllib.loads(path.read_text())
    try:
        loaded = cluster_config.load(path)
    except ConfigError as error:
        message = str(error)
        assert "\n" not in message and "Traceback" not in message, message
        assert key in message, message
        return
    # taken: as written (an int where a number goes), never coerced from another type
    written = tomllib.loads(f"v = {VALUES[kind]}")["v"]
    holder = {
        "run": loaded,
        "model": loaded.model,
        "sync": loaded.sync,
        "merger": loaded.merger,
        "regions": loaded.regions[0],
    }[section]
    value = getattr(holder, key)
    if (section, key) in PATHS:
        return
    assert value == written, (value, written)
    # a bool only where the key is a switch (Python's True is also the int 1)
    declared = (
        _RUN_TYPES[key].__name__
        if section == "run"
        else {f.name: str(f.type) for f in dataclasses.fields(type(holder))}[key]
    )
    assert not isinstance(written, bool) or "bool" in declared, (key, declared)


# made absolute (the cluster file's neighbours), or stored under another name
PATHS = {("model", "corpus"), ("model", "tokens"), ("model", "task")}


def test_dloco_up_names_what_a_file_leaves_to_defaults_unlike_the_profile(tmp_path):
    """A cluster file without [sync] interval or [merger] outer_lr runs DiLoCo's H = 50 and
    lr 0.7, not what the profile measured best: `dloco up` says so, naming each."""
    path = tmp_path / "partial.toml"
    path.write_text('[[regions]]\nname = "a"\n\n[sync]\nfragments = 4\n\n[merger]\nquorum = 1\n')
    found = cluster_config.unlike_the_profile(cluster_config.load(path))
    assert "sync.interval = 50 (the profile: 12)" in found
    assert "merger.outer_lr = 0.7 (the profile: 0.15)" in found
    # what the file sets, and what equals the profile anyway, are not named
    assert not any(f.startswith(("sync.fragments", "merger.quorum", "model.")) for f in found)
    assert cluster_config.unlike_the_profile(cluster_config.load()) == []
