"""`flexpipe serve`'s flags and files are refused in one line before a pipeline starts: the API key file
through the capped reader (a FIFO, a device, binary), a host this machine cannot listen on, a drain
timeout that is not a finite number of seconds."""

from __future__ import annotations

import argparse
import os

import pytest

from flexpipe_dag.cli.serve import read_api_key
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.serving.frontdoor.server import ServerSettings


def test_the_api_key_file_is_read_through_the_capped_reader(tmp_path):
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="--api-key-file: is a FIFO"):
        read_api_key(fifo)  # returns at once: a FIFO is refused before it is opened for reading
    with pytest.raises(InputError, match="--api-key-file: is a device"):
        read_api_key(type(tmp_path)("/dev/zero"))
    binary = tmp_path / "key.bin"
    binary.write_bytes(b"\xff\xfe\n")
    with pytest.raises(InputError, match="--api-key-file: not UTF-8"):
        read_api_key(binary)
    huge = tmp_path / "key.big"
    huge.write_text("k" * 10_000)
    with pytest.raises(InputError, match="--api-key-file"):
        read_api_key(huge)
    good = tmp_path / "key"
    good.write_text("  s3cret  \nsecond line ignored\n")
    assert read_api_key(good) == "s3cret"


@pytest.mark.parametrize(("host", "problem"), [("999.1.1.1", "does not resolve"), ("10.255.254.253", "cannot listen"),
                                               ("bad host name", "does not resolve")])
def test_a_host_this_machine_cannot_listen_on_is_refused_naming_the_flag(host, problem):
    with pytest.raises(InputError, match=f"--host: .*{problem}"):
        ServerSettings(host=host, port=0, api_key="k", model_name="m").check()
    ServerSettings(host="127.0.0.1", port=0, api_key=None, model_name="m").check()


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e9"])
def test_a_drain_timeout_that_is_not_a_finite_duration_is_refused_before_the_model_loads(value):
    from flexpipe_dag.cli.serve import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--stages", "2", "--no-store", "--drain-timeout-s", value])
    with pytest.raises(InputError, match="--drain-timeout-s: expected a finite number >= 0"):
        args.func(args)


@pytest.mark.parametrize("value", ["0", "-5", str((1 << 20) + 1)])
def test_a_chunked_prefill_budget_out_of_range_is_refused_before_the_model_loads(value):
    from flexpipe_dag.cli.serve import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--stages", "2", "--no-store", "--chunked-prefill-tokens", value])
    with pytest.raises(InputError, match=f"--chunked-prefill-tokens: expected 1..1048576 tokens per micro-batch, got {value}"):
        args.func(args)


@pytest.mark.parametrize(("flag", "value", "top"), [("--micro-batch-size", "70000", 65536), ("--micro-batch-size", "0", 65536),
                                                   ("--inflight", "5000", 4096), ("--inflight", "0", 4096)])
def test_a_gear_shape_a_gear_cannot_hold_is_refused_naming_the_flag(flag, value, top):
    from flexpipe_dag.cli.serve import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--stages", "1", "--no-store", flag, value])
    with pytest.raises(InputError, match=f"{flag}: expected an integer 1..{top}, got {value}"):
        args.func(args)
