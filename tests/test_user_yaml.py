"""User YAML (cluster profiles, control files, gears) is read strictly: no duplicate keys, no aliases."""

from __future__ import annotations

import time

import pytest

from flexpipe_dag.control.settings import resolve_control_settings
from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.user_yaml import load_user_yaml


def test_duplicate_keys_are_refused_with_their_line():
    with pytest.raises(InputError, match=r"^f\.yaml: .*duplicate key 'dwell_s'.*line 3"):
        load_user_yaml("controller:\n  dwell_s: 10\n  dwell_s: 20\n", "f.yaml")


def test_alias_bombs_are_refused_at_once(tmp_path):
    # nine levels of nine-way aliases: 9**9 leaves if expanded
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    path = tmp_path / "bomb.yaml"
    path.write_text("controller:\n  dwell_s: 1\n" + "\n".join(lines) + "\n")
    start = time.monotonic()
    with pytest.raises(InputError, match=r"aliases \(\*a0\) are not accepted"):
        resolve_control_settings(str(path))
    assert time.monotonic() - start < 5.0


def test_deep_nesting_is_refused_not_crashed(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("controller:\n  dwell_s: " + "[" * 5000 + "\n")
    with pytest.raises(InputError, match="deep.yaml"):
        resolve_control_settings(str(path))


@pytest.mark.parametrize("text", ["false\n", "0\n", "[]\n", "''\n"])
def test_a_control_file_that_is_not_a_mapping_is_refused(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match="expected a mapping with 'controller' and/or 'tide' sections"):
        resolve_control_settings(str(path))
    path.write_text("")  # an empty file is the seeds
    assert resolve_control_settings(str(path)).controller.dwell_s == 600.0


def test_a_section_that_is_not_a_mapping_is_named_without_echoing_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("controller: [" + ", ".join(["1"] * 10_000) + "]\n")
    with pytest.raises(InputError) as err:
        resolve_control_settings(str(path))
    assert "controller" in str(err.value) and len(str(err.value)) < 300


def test_cluster_files_refuse_duplicate_nodes_keys(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("cluster_id: a\ncluster_id: b\nnodes: []\n")
    with pytest.raises(InputError, match="duplicate key 'cluster_id'"):
        load_cluster_profile(path)


def test_an_empty_file_name_is_not_read_as_the_working_directory():
    # `--cluster ""` was refused as ".: is a directory", naming a directory the user never gave
    with pytest.raises(InputError) as err:
        load_cluster_profile("")
    assert str(err.value) == "an empty file name; expected the path of a cluster profile"
