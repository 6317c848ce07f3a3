"""A joiner decides what it runs: no local path a remote manifest names, no model beyond its limits (issue 14)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from lab.swarm import crowdtrain

from crowdtrain.errors import BadInputError
from crowdtrain.manifest import DataSpec, RunManifest, demo, llama_85m
from crowdtrain.node.limits import TRAINING_BYTES_PER_PARAMETER, check_remote_manifest
from tests.harness import start_daemon
from tests.test_cli_errors import assert_plain_failure

GIB = 2**30


def files_run(path: Path | str) -> RunManifest:
    return dataclasses.replace(demo(), data=DataSpec(source="files", path=str(path)))


@pytest.mark.parametrize("path", ["/etc", "~/.ssh", "/proc/self/environ", "/srv/shared/../../etc"])
def test_a_remote_manifest_naming_a_local_path_is_refused(path: str) -> None:
    with pytest.raises(BadInputError, match="data_paths"):
        check_remote_manifest(files_run(path), data_paths=(), max_parameters=10**9, available_bytes=None)
    with pytest.raises(BadInputError, match="data_paths"):
        check_remote_manifest(files_run(path), data_paths=("/srv/shared",), max_parameters=10**9, available_bytes=None)


def test_a_path_inside_the_volunteers_data_paths_is_allowed(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    manifest = files_run(tmp_path / "corpus" / "part1.txt")
    check_remote_manifest(manifest, data_paths=(str(tmp_path),), max_parameters=10**9, available_bytes=None)
    check_remote_manifest(demo(), data_paths=(), max_parameters=10**9, available_bytes=None)  # the embedded corpus


def test_a_model_beyond_the_nodes_limits_is_refused_before_anything_is_allocated() -> None:
    big = llama_85m()  # 85M parameters, counted on the meta device
    with pytest.raises(BadInputError, match="max_parameters"):
        check_remote_manifest(big, data_paths=(), max_parameters=50_000_000, available_bytes=None)
    with pytest.raises(BadInputError, match="GiB available"):
        check_remote_manifest(big, data_paths=(), max_parameters=10**9, available_bytes=GIB)
    check_remote_manifest(
        big, data_paths=(), max_parameters=10**9, available_bytes=100_000_000 * TRAINING_BYTES_PER_PARAMETER
    )


@pytest.mark.swarm
def test_a_joiner_refuses_a_run_that_reads_its_local_files_and_exits_2(tmp_path: Path) -> None:
    corpus = tmp_path / "founder-data"
    corpus.mkdir()
    (corpus / "text.txt").write_text("the founder's own text, which it chose to train on\n" * 200)
    run_file = tmp_path / "files.toml"
    run_file.write_text(f'run_id = "files"\n[data]\nsource = "files"\npath = "{corpus}"\n')
    founder = start_daemon(tmp_path / "founder", "--run-file", str(run_file)).await_ready()
    result = crowdtrain("run", "--state-dir", str(tmp_path / "joiner"), "--initial-peers", founder.address)
    assert_plain_failure(result, 2, "local path", "data_paths")
