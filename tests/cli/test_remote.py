"""Commands over URLs, against real servers on the loopback interface (HTTP with Range, moto's S3, a stand-in for
the Hugging Face Hub): the same JSON as the local files, paths apart; bytes fetched counted by the server.
HTTP needs no extra; S3 and the Hub (fsspec, s3fs, huggingface_hub, moto) skip without theirs."""

from __future__ import annotations

import itertools
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from clipcli.checkpoint import open_checkpoint
from clipcli.checkpoint import remote as _remote
from tests.helpers import DATA, SAMPLES, fnorm, ok, run
from tests.servers import hub_routes, range_server, s3_server

GIB = 1 << 30
PATHS = {
    "path",
    "file",
    "files",
    "a",
    "b",
    "output",
}  # fields that name where a checkpoint is: the URL or the local path


def without_paths(report: object) -> object:
    """A JSON report with the fields that name files left out."""
    if isinstance(report, dict):
        return {k: without_paths(v) for k, v in report.items() if k not in PATHS}
    if isinstance(report, list):
        return [without_paths(v) for v in report]
    return report


def as_json(*args: object) -> dict:
    return json.loads(ok(*args, "--format", "json").stdout)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The checkpoints every server holds, by name: samples, a sharded index and a 1 GiB sparse file."""
    tmp = tmp_path_factory.mktemp("remote")
    big = tmp / "big.safetensors"  # 1 GiB of zeros (a hole) and a small tensor after it
    header = json.dumps(
        {
            "big": {"dtype": "F32", "shape": [GIB // 4], "data_offsets": [0, GIB]},
            "small": {"dtype": "F32", "shape": [1000], "data_offsets": [GIB, GIB + 4000]},
        }
    ).encode()
    with open(big, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + GIB)
        f.seek(0, 2)
        f.write(np.linspace(-3, 3, 1000, dtype=np.float32).tobytes())
    wide = tmp / "wide.safetensors"  # 80 MiB, past the size where local reads fork their workers
    save_file({"w": np.zeros(1, np.float32)}, str(wide))
    header = json.dumps({"w": {"dtype": "F32", "shape": [20 << 20], "data_offsets": [0, 80 << 20]}}).encode()
    with open(wide, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + (80 << 20) - 4)
        f.seek(0, 2)
        f.write(np.float32(3).tobytes())
    many = tmp / "many.safetensors"  # 8 tensors of 12 MiB (holes, and each one's number at its end)
    header = json.dumps(
        {
            f"m{i}": {"dtype": "F32", "shape": [3 << 20], "data_offsets": [i * (12 << 20), (i + 1) * (12 << 20)]}
            for i in range(8)
        }
    ).encode()
    with open(many, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for i in range(8):
            f.seek(8 + len(header) + (i + 1) * (12 << 20) - 4)
            f.write(np.float32(i + 1).tobytes())
    values = tmp / "values.safetensors"
    rng = np.random.default_rng(7)
    save_file({f"layer{i}.w": rng.standard_normal(1 << 20).astype(np.float32) for i in range(6)}, str(values))
    out = {
        "grads.safetensors": SAMPLES / "grads.safetensors",
        "pytorch_model.bin": SAMPLES / "pytorch_model.bin",
        "big.safetensors": big,
        "values.safetensors": values,
        "wide.safetensors": wide,
        "many.safetensors": many,
    }
    for p in (SAMPLES / "sharded").iterdir():
        out[f"sharded/{p.name}"] = p
    return out


@pytest.fixture(scope="module")
def http(files):
    with range_server(files) as server:
        yield server


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(_remote, "BACKOFF_S", 0.001)


COMMANDS = [
    ("inspect", "grads.safetensors"),
    ("inspect", "sharded/model.safetensors.index.json"),
    ("inspect", "pytorch_model.bin"),
    ("global-norm", "grads.safetensors", "--depth", "2"),
    ("global-norm", "sharded/model.safetensors.index.json"),
    ("global-norm", "pytorch_model.bin"),
    ("hash", "grads.safetensors"),
    ("stats", "grads.safetensors", "--depth", "2"),
    ("stats", "pytorch_model.bin"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_command_over_http_reports_what_the_local_file_gives(http, files, command):
    name, *options = command[1:]
    remote = as_json(command[0], f"{http.url}/{name}", *options)
    assert without_paths(remote) == without_paths(as_json(command[0], files[name], *options))
    assert remote["checkpoints"][0]["path"] == f"{http.url}/{name}"


# a finding of review 30: a sharded index at a URL with a query (a presigned URL's signature, a token) was refused as
# a directory (its suffix was read with the query), and its shards were asked for without the query
@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_url_with_a_query_sends_it_for_each_file_and_never_shows_it(files, command):
    name, *options = command[1:]
    query = "X-Amz-Signature=0a1b&token=s%2Fecret"
    with range_server(files) as server:
        server.query = query
        result = run(command[0], f"{server.url}/{name}?{query}#part", *options, "--format", "json")
        assert result.exit_code == 0, result.stderr
        assert "ecret" not in result.stdout + result.stderr
        remote = json.loads(result.stdout)
        assert without_paths(remote) == without_paths(as_json(command[0], files[name], *options))
        assert remote["checkpoints"][0]["path"] == f"{server.url}/{name}"
        assert len({path for _, path, _ in server.requests}) == (3 if name.startswith("sharded") else 1)
        failed = run(command[0], f"{server.url}/{name}?token=other")
        assert failed.exit_code == 3 and "403" in failed.stderr and "other" not in failed.stderr


def test_diff_of_a_url_against_a_local_file_and_convert_to_a_local_output(http, files, tmp_path):
    url = f"{http.url}/pytorch_model.bin"
    expected = as_json("diff", files["pytorch_model.bin"], files["pytorch_model.bin"])
    assert without_paths(as_json("diff", url, files["pytorch_model.bin"])) == without_paths(expected)
    converted = as_json("convert", url, "-o", tmp_path / "remote.safetensors")
    assert without_paths(converted) == without_paths(
        as_json("convert", files["pytorch_model.bin"], "-o", tmp_path / "local.safetensors")
    )
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    clipped = tmp_path / "clipped.safetensors"
    ok("clip-global-norm", f"{http.url}/grads.safetensors", "-o", clipped, "--clip-norm", "1", "--quiet")
    ok("clip-global-norm", files["grads.safetensors"], "-o", tmp_path / "c2.safetensors", "--clip-norm", "1", "-q")
    assert clipped.read_bytes() == (tmp_path / "c2.safetensors").read_bytes()


def test_inspect_of_a_1_gib_url_transfers_less_than_1_percent(http):
    http.reset()
    listing = as_json("inspect", f"{http.url}/big.safetensors")
    assert listing["checkpoints"][0]["nbytes"] == GIB + 4000
    assert http.sent <= GIB // 100
    assert http.sent <= 64 << 10  # in fact one read of the first 64 KiB


def test_include_fetches_only_the_selected_tensors(http):
    http.reset()
    report = as_json("global-norm", f"{http.url}/big.safetensors", "--include", "small")
    assert report["checkpoints"][0]["global_norm"] == pytest.approx(
        fnorm([np.linspace(-3, 3, 1000, dtype=np.float32)]), rel=1e-15
    )
    assert http.sent == (64 << 10) + 4000  # the header's first read, then the 4000 bytes of `small`


@pytest.mark.parametrize("jobs", ["1", "3", "8"])
def test_read_ahead_asks_for_every_selected_byte_once_and_for_no_other(http, files, jobs):
    # the chunks of tensors lying together come from ranged GETs left open for the next ones (remote._Streams),
    # whichever thread reads them
    with open_checkpoint(files["many.safetensors"]) as ckpt:
        spans = {t.name: (t.location.offset, t.location.offset + t.nbytes) for t in ckpt.tensors}
    selected = [spans["m1"], (spans["m3"][0], spans["m4"][1]), spans["m6"]]  # m3 and m4 lie together
    http.reset()
    url = f"{http.url}/many.safetensors"
    report = as_json("global-norm", url, "--include", "m[1346]", "--jobs", jobs)
    assert report["checkpoints"][0]["global_norm"] == float(np.sqrt(4 + 16 + 25 + 49))
    asked = sorted(_asked(r) for method, _, r in http.requests if method == "GET" and r != "bytes=0-65535")
    assert all(any(a <= start and end <= b for a, b in selected) for start, end in asked)  # nothing else
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(asked))  # nothing twice
    assert sum(end - start for start, end in asked) == 4 * (12 << 20)  # everything
    assert http.sent == (64 << 10) + 4 * (12 << 20)
    if jobs == "1":
        assert len(asked) == 3  # one request for each run of tensors lying together (m3 and m4), not one a chunk


def _asked(header: str) -> tuple[int, int]:
    """The bytes [start, end) a `Range: bytes=first-last` header asks for."""
    first, last = header.removeprefix("bytes=").split("-")
    return int(first), int(last) + 1


@pytest.mark.parametrize("jobs", ["2", "8"])
def test_the_workers_give_the_same_bytes_as_one(http, jobs):
    url = f"{http.url}/values.safetensors"
    one = ok("global-norm", url, "--format", "json", "--jobs", "1").stdout
    assert ok("global-norm", url, "--format", "json", "--jobs", jobs).stdout == one


def test_a_large_url_is_read_by_threads_not_forked_workers(http, files):
    # a forked worker would share the parent's connections (and fsspec's event loop): the engine's threads read
    report = as_json("global-norm", f"{http.url}/wide.safetensors", "--jobs", "2")
    assert without_paths(report) == without_paths(as_json("global-norm", files["wide.safetensors"], "--jobs", "2"))
    assert report["checkpoints"][0]["global_norm"] == 3.0


@pytest.mark.parametrize("failure", ["503", "cut"])
def test_a_failure_mid_stream_is_retried_and_the_result_is_the_same(http, quick, failure):
    url = f"{http.url}/values.safetensors"
    expected = ok("global-norm", url, "--format", "json", "--jobs", "4").stdout
    http.reset()
    http.fail = ["ok", failure]  # the header is read; then the read of the tensors' bytes fails once
    assert ok("global-norm", url, "--format", "json", "--jobs", "4").stdout == expected
    assert not http.fail


def test_a_404_is_exit_3_with_one_line(http):
    result = run("global-norm", f"{http.url}/missing.safetensors")
    assert result.exit_code == 3
    assert result.stderr == f"clipcli: error: {http.url}/missing.safetensors: no such file or directory\n"


def test_outputs_are_local_paths(http, tmp_path):
    url = f"{http.url}/grads.safetensors"
    result = run("convert", url, "-o", f"{http.url}/out.safetensors")
    assert result.exit_code == 2
    assert "outputs are local paths, not URLs" in result.stderr
    result = run("clip-global-norm", url, "--in-place", "--clip-norm", "1")
    assert result.exit_code == 2
    assert "a URL cannot be replaced in place" in result.stderr
    result = run("global-norm", url, "--report", f"{http.url}/report.json")
    assert result.exit_code == 2


def test_without_the_remote_extra_https_reads_and_s3_is_a_usage_error_naming_it(http):
    code = (
        "import sys; sys.modules['fsspec'] = None\n"
        "from clipcli.cli import main\n"
        "try: main(['global-norm', '--format', 'json', sys.argv[1]])\n"
        "except SystemExit as e: print(e.code)\n"
        "main(['inspect', 's3://bucket/grads.safetensors'])\n"
    )
    url = f"{http.url}/grads.safetensors"
    done = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    needs = "reading s3:// URLs needs fsspec: pip install 'clipcli[remote]'"
    assert done.stderr == f"clipcli: error: s3://bucket/grads.safetensors: {needs}\n"
    report = json.loads(done.stdout[: done.stdout.rindex("}") + 1])
    assert without_paths(report) == without_paths(as_json("global-norm", SAMPLES / "grads.safetensors"))


def test_a_local_run_imports_nothing_remote(tmp_path):
    code = (
        "import sys; from clipcli.cli import main\n"
        "for argv in (['--help'], ['inspect', {!r}]):\n"
        "    try: main(argv)\n"
        "    except SystemExit: pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fsspec', 'aiohttp', 'http')"
        " or m.startswith(('clipcli.checkpoint.remote', 'clipcli.checkpoint.httpfs'))))"
    ).format(str(SAMPLES / "grads.safetensors"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


# S3 (moto's server) -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(files, tmp_path_factory):
    pytest.importorskip("fsspec")
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    objects = {k: v for k, v in files.items() if k not in ("big.safetensors", "wide.safetensors")}
    dcp = DATA / "dcp" / "sharded"
    objects.update({f"dcp/{p.relative_to(dcp)}": p for p in dcp.rglob("*") if p.is_file()})
    with s3_server("ckpts", objects):
        yield "s3://ckpts"


@pytest.mark.parametrize(
    "command", [*COMMANDS, ("inspect", "sharded"), ("global-norm", "sharded"), ("global-norm", "dcp")], ids=" ".join
)
def test_a_command_over_s3_reports_what_the_local_file_gives(s3, files, command):
    name, *options = command[1:]
    local_path = (
        DATA / "dcp" / "sharded" if name == "dcp" else SAMPLES / "sharded" if name == "sharded" else files[name]
    )
    remote = as_json(command[0], f"{s3}/{name}", *options)
    assert without_paths(remote) == without_paths(as_json(command[0], local_path, *options))
    assert remote["checkpoints"][0]["path"] == f"{s3}/{name}"


def test_diff_and_convert_over_s3(s3, files, tmp_path):
    url = f"{s3}/grads.safetensors"
    assert as_json("diff", url, files["grads.safetensors"])["identical_count"] == 16
    ok("convert", f"{s3}/pytorch_model.bin", "-o", tmp_path / "s3.safetensors", "--quiet")
    ok("convert", files["pytorch_model.bin"], "-o", tmp_path / "local.safetensors", "--quiet")
    assert (tmp_path / "s3.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()


def test_a_missing_s3_key_is_exit_3_with_one_line(s3):
    result = run("inspect", f"{s3}/missing.safetensors")
    assert result.exit_code == 3
    assert result.stderr == f"clipcli: error: {s3}/missing.safetensors: no such file or directory\n"


# The Hugging Face Hub (a stand-in on the loopback interface, through HF_ENDPOINT) ------------------------------


@pytest.fixture(scope="module")
def hub_server(files):
    pytest.importorskip("fsspec")
    pytest.importorskip("huggingface_hub")
    with range_server({}) as server:
        small = {k: v for k, v in files.items() if k not in ("big.safetensors", "wide.safetensors")}
        hub_routes(server, "org/model", "main", small)
        yield server


@pytest.fixture
def hub(hub_server, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return hub_server


@pytest.mark.parametrize("command", [*COMMANDS, ("global-norm", "sharded")], ids=" ".join)
def test_a_command_over_the_hub_reports_what_the_local_file_gives(hub, files, command):
    name, *options = command[1:]
    local_path = SAMPLES / "sharded" if name == "sharded" else files[name]
    remote = as_json(command[0], f"hf://org/model/{name}", *options)
    assert without_paths(remote) == without_paths(as_json(command[0], local_path, *options))
    assert remote["checkpoints"][0]["path"] == f"hf://org/model/{name}"
    at_revision = as_json(command[0], f"hf://org/model@main/{name}", *options)
    assert without_paths(at_revision) == without_paths(remote)


def test_the_hub_serves_headers_and_tensors_by_range(hub, files):
    hub.reset()
    report = as_json("global-norm", "hf://org/model/values.safetensors", "--include", "layer3.w")
    data = [r for r in hub.requests if "/resolve/" in r[1]]
    assert [r[2] for r in data] == ["bytes=0-65535", f"bytes={_offset(files, 'layer3.w')}-{_end(files, 'layer3.w')}"]
    assert report["checkpoints"][0]["tensor_count"] == 1


def test_diff_and_convert_over_the_hub(hub, files, tmp_path):
    assert as_json("diff", "hf://org/model/grads.safetensors", files["grads.safetensors"])["identical_count"] == 16
    ok("convert", "hf://org/model/pytorch_model.bin", "-o", tmp_path / "hub.safetensors", "--quiet")
    ok("convert", files["pytorch_model.bin"], "-o", tmp_path / "local.safetensors", "--quiet")
    assert (tmp_path / "hub.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()


@pytest.mark.parametrize("url", ["hf://org/model/missing.safetensors", "hf://org/nothing/a.safetensors"])
def test_a_missing_hub_file_or_repository_is_exit_3_with_one_line(hub, url):
    result = run("inspect", url)
    assert result.exit_code == 3
    assert result.stderr == f"clipcli: error: {url}: no such file or directory\n"


def _offset(files: dict[str, Path], name: str) -> int:
    """Where a tensor's bytes start in values.safetensors (its header read here, by hand)."""
    with open(files["values.safetensors"], "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return 8 + n + json.loads(f.read(n))[name]["data_offsets"][0]


def _end(files: dict[str, Path], name: str) -> int:
    return _offset(files, name) + (4 << 20) - 1  # 1 << 20 float32 values


@pytest.mark.parametrize("name", ["grads.safetensors", "sharded/model.safetensors.index.json", "pytorch_model.bin"])
def test_verify_over_http_reports_what_the_local_file_gives(http, files, name, tmp_path):
    # found trying verify on a URL: its structural pass opened the path as a local file (exit 3, then 70)
    manifest = tmp_path / "m.json"
    manifest.write_text(ok("hash", files[name], "--format", "json").stdout)
    for options in ((), ("--values",), ("--manifest", manifest)):
        remote = as_json("verify", f"{http.url}/{name}", *options)
        assert without_paths(remote) == without_paths(as_json("verify", files[name], *options))
        assert remote["ok"] is True and remote["path"] == f"{http.url}/{name}"


def test_verify_over_s3_sees_a_stray_shard(s3, files):
    # S3 lists a directory: a shard the index leaves out is found there as it is locally
    report = json.loads(run("verify", f"{s3}/sharded", "--format", "json").stdout)
    assert report["ok"] is True
    broken = json.loads(run("verify", f"{s3}/sharded/model.safetensors.index.json", "--format", "json").stdout)
    assert broken["ok"] is True


def test_trajectory_over_http_flags_the_same_tensors_as_identical(http):
    report = as_json("trajectory", f"{http.url}/grads.safetensors", f"{http.url}/pytorch_model.bin", "--keep-order")
    assert [c["identical_to_previous"] for c in report["checkpoints"]] == [False, True]


def test_verify_names_a_url_as_given_in_its_findings(files, tmp_path):
    # found by a new user: a finding's file read http:/host/... (one slash)
    broken = tmp_path / "g.safetensors"
    broken.write_bytes(files["grads.safetensors"].read_bytes() + b"trailing")
    with range_server({"g.safetensors": broken}) as server:
        report = json.loads(run("verify", f"{server.url}/g.safetensors", "--format", "json").stdout)
    assert [f["file"] for f in report["findings"]] == [f"{server.url}/g.safetensors"]


# gh-24: a distributed checkpoint's directory over plain http:// failed with "no such file" (HTTP cannot list a
# directory); its .metadata names every other file, and a sharded directory's usual index names its shards
@pytest.mark.parametrize(
    ("name", "local", "read"),
    [
        ("dcp", DATA / "dcp" / "sharded", "dcp"),
        ("dcp/", DATA / "dcp" / "sharded", "dcp"),
        ("sharded/", SAMPLES / "sharded", "sharded/model.safetensors.index.json"),
    ],
)
def test_a_directory_over_plain_http_is_read_through_the_file_that_marks_its_format(name, local, read):
    dcp = DATA / "dcp" / "sharded"
    files = {f"dcp/{p.name}": p for p in dcp.iterdir()}  # .metadata included
    files.update({f"sharded/{p.name}": p for p in (SAMPLES / "sharded").iterdir()})
    with range_server(files) as server:
        remote = as_json("global-norm", f"{server.url}/{name}")
        assert without_paths(remote) == without_paths(as_json("global-norm", local))
        assert remote["checkpoints"][0]["path"] == f"{server.url}/{read}"
        assert all(method in ("HEAD", "GET") for method, _, _ in server.requests)


# issue 26: a web server's usual answers to a directory's URL (403; a redirect to `.../` then 403; an HTML listing,
# with or without Range) were taken for the checkpoint's ("cannot read: HTTP 403 Forbidden", "the file is an HTML
# page"), and its markers never asked for; the messages dropped the `/` typed
@pytest.mark.parametrize("directories", ["403", "redirect", "html", "html-whole"])
@pytest.mark.parametrize(("name", "local"), [("dcp", DATA / "dcp" / "sharded"), ("sharded/", SAMPLES / "sharded")])
def test_a_directory_is_read_through_its_marker_whatever_the_server_answers_for_it(directories, name, local):
    files = {f"dcp/{p.name}": p for p in (DATA / "dcp" / "sharded").iterdir()}
    files.update({f"sharded/{p.name}": p for p in (SAMPLES / "sharded").iterdir()})
    with range_server(files) as server:
        server.directories = directories
        remote = as_json("global-norm", f"{server.url}/{name}")
        assert without_paths(remote) == without_paths(as_json("global-norm", local))


@pytest.mark.parametrize(
    ("directories", "error"),
    [
        ("403", "cannot read: HTTP 403 Forbidden"),
        ("html", "unknown checkpoint suffix"),
        ("html-whole", "cannot read: the server does not honour range requests"),
    ],
)
def test_a_directory_with_no_marker_keeps_its_own_error_and_the_url_as_typed(directories, error):
    with range_server({"d/notes.txt": SAMPLES / "grads.safetensors"}) as server:
        server.directories = directories
        result = run("inspect", f"{server.url}/d/")
    assert result.exit_code == 3
    assert result.stderr.startswith(f"clipcli: error: {server.url}/d/: {error}")
    assert result.stderr.count("\n") == 1


def test_a_url_that_names_no_file_and_no_marked_directory_says_what_to_name():
    with range_server({}) as server:
        result = run("inspect", f"{server.url}/nothing/")
    assert result.exit_code == 3
    assert result.stderr == (
        f"clipcli: error: {server.url}/nothing/: no such file, and no directory holding .metadata, "
        "model.safetensors.index.json, pytorch_model.bin.index.json: plain HTTP cannot list a directory; name a "
        "file, a sharded index, or a directory holding one of those\n"
    )


def test_verify_of_a_url_with_a_query_never_shows_it(files):
    """Review 31: verify's report showed the URL as typed, token and all."""
    with range_server(files) as server:
        server.query = "token=s3cr3t"
        for options in ((), ("--format", "json")):
            result = run("verify", f"{server.url}/sharded/model.safetensors.index.json?token=s3cr3t", *options)
            assert result.exit_code == 0, result.stderr
            assert "s3cr3t" not in result.stdout + result.stderr
            assert f"{server.url}/sharded/model.safetensors.index.json" in result.stdout


def test_a_shard_the_server_refuses_is_named_not_its_index(files):
    """Review 31: a 403 on a shard (a signature made for the index alone) was blamed on the index."""
    shard = "sharded/model-00002-of-00002.safetensors"
    with range_server(files) as server:
        server.routes[f"/{shard}"] = (403, {}, b"no")
        for url in (f"{server.url}/sharded/model.safetensors.index.json?sig=A", f"{server.url}/sharded"):
            result = run("inspect", url)
            assert result.exit_code == 3
            assert result.stderr == f"clipcli: error: {server.url}/{shard}: cannot read: HTTP 403 Forbidden\n"


@pytest.mark.parametrize(
    ("typed", "sent"),
    [("token=a b", "token=a%20b"), ("token=€é", "token=%E2%82%AC%C3%A9"), ("t=%2F%zz&x=1/2?3", "t=%2F%zz&x=1/2?3")],
)
def test_a_query_is_sent_as_curl_sends_it(files, typed, sent):
    """Review 31: a space went raw (a 400 whose reason showed the token), a character past ASCII failed to encode."""
    with range_server(files) as server:
        server.query = sent
        assert run("inspect", f"{server.url}/grads.safetensors?{typed}").exit_code == 0
