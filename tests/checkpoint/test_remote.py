"""The remote store against real servers on the loopback interface: every format read over HTTP as from its
file, ranged reads of what is asked only, retries of transient failures, one error for what is missing.
HTTP needs no extra; the tests that go through fsspec skip without it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
from safetensors.numpy import save_file

from clipcli.checkpoint import httpfs, open_checkpoint
from clipcli.checkpoint import remote as _remote
from clipcli.errors import ExitStatus, InputError, MissingFileError, UsageError
from tests.helpers import DATA, SAMPLES, dcp_checkpoint
from tests.servers import range_server


@pytest.fixture
def quick(monkeypatch):
    """Retries without the production backoff (the tests' servers answer at once)."""
    monkeypatch.setattr(_remote, "BACKOFF_S", 0.001)


def contents(ckpt) -> tuple:
    """What a checkpoint holds: its format, metadata, and each tensor's name, type, shape and values."""
    return ckpt.format, ckpt.metadata, [(t.name, t.dtype, t.shape, ckpt.read(t).tobytes()) for t in ckpt.tensors]


def local_files(tmp_path: Path) -> dict[str, Path]:
    """A checkpoint of each format, by the name the server gives it."""
    np.save(tmp_path / "w.npy", np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4) / 7))
    np.savez(tmp_path / "m.npz", a=np.linspace(-1, 1, 9), b=np.arange(5, dtype=">i4"))
    np.savez_compressed(tmp_path / "z.npz", a=np.linspace(-1, 1, 9))
    files = {
        "grads.safetensors": SAMPLES / "grads.safetensors",
        "pytorch_model.bin": SAMPLES / "pytorch_model.bin",
        "w.npy": tmp_path / "w.npy",
        "m.npz": tmp_path / "m.npz",
        "z.npz": tmp_path / "z.npz",
    }
    for p in (SAMPLES / "sharded").iterdir():
        files[f"sharded/{p.name}"] = p
    return files


@pytest.mark.parametrize(
    "name",
    ["grads.safetensors", "pytorch_model.bin", "w.npy", "m.npz", "z.npz", "sharded/model.safetensors.index.json"],
)
def test_each_format_over_http_reads_as_from_its_file(tmp_path, name):
    files = local_files(tmp_path)
    local = (SAMPLES / name) if name.startswith("sharded/") else files[name]
    with open_checkpoint(local) as ckpt:
        expected = contents(ckpt)
    with range_server(files) as server, open_checkpoint(f"{server.url}/{name}") as ckpt:
        assert contents(ckpt) == expected
        assert isinstance(ckpt.store, _remote.RemoteStore)
        assert str(ckpt.path) == f"{server.url}/{name}".replace("://", ":/", 1)  # pathlib's form, shown with //


def test_a_header_is_read_by_ranges_not_the_whole_file(tmp_path):
    big = tmp_path / "big.safetensors"
    save_file({f"t{i}": np.full(1 << 18, i, np.float32) for i in range(8)}, str(big))  # 8 MiB
    with range_server({"big.safetensors": big}) as server:
        with open_checkpoint(f"{server.url}/big.safetensors") as ckpt:
            assert [t.name for t in ckpt.tensors] == [f"t{i}" for i in range(8)]
        assert server.sent <= 64 << 10
        assert all(method == "HEAD" or rng == "bytes=0-65535" for method, _, rng in server.requests)


def test_only_the_tensor_read_is_fetched(tmp_path):
    path = tmp_path / "two.safetensors"
    save_file({"a": np.arange(1 << 20, dtype=np.float32), "b": np.arange(1000, dtype=np.float32)}, str(path))
    with range_server({"two.safetensors": path}) as server, open_checkpoint(f"{server.url}/two.safetensors") as ckpt:
        server.reset()
        b = next(t for t in ckpt.tensors if t.name == "b")
        np.testing.assert_array_equal(ckpt.read(b), np.arange(1000, dtype=np.float32))
        assert server.sent == 4000  # b's bytes, after a's 4 MiB
        assert len(server.requests) == 1


@pytest.mark.parametrize("failure", ["503", "cut"])
def test_a_transient_failure_is_retried_and_the_values_are_the_same(tmp_path, quick, failure):
    path = tmp_path / "a.safetensors"
    values = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    save_file({"a": values}, str(path))
    with range_server({"a.safetensors": path}) as server, open_checkpoint(f"{server.url}/a.safetensors") as ckpt:
        server.fail = [failure, failure]
        server.reset()
        np.testing.assert_array_equal(ckpt.read(ckpt.tensors[0]), values)
        assert len(server.requests) == 3  # two failures, then the read
        assert not server.fail


def test_a_body_that_stalls_is_given_up_after_the_timeout_and_retried(tmp_path, quick, monkeypatch):
    # a body is received by one blocking recv (MSG_WAITALL): its timeout must still end the wait, as transient
    monkeypatch.setattr(httpfs, "_TIMEOUT_S", 0.2)
    path = tmp_path / "a.safetensors"
    values = np.random.default_rng(1).standard_normal(1 << 20).astype(np.float32)
    save_file({"a": values}, str(path))
    with range_server({"a.safetensors": path}) as server, open_checkpoint(f"{server.url}/a.safetensors") as ckpt:
        server.fail = ["stall"]
        server.reset()
        np.testing.assert_array_equal(ckpt.read(ckpt.tensors[0]), values)
        assert len(server.requests) == 2  # the stalled one, then the read
        assert not server.fail


def test_a_tensor_read_in_chunks_is_one_ranged_get_read_on(tmp_path):
    path = tmp_path / "a.safetensors"
    values = np.random.default_rng(2).standard_normal(3 << 20).astype(np.float32)  # 12 MiB
    save_file({"a": values, "b": values[:1000]}, str(path))
    with range_server({"a.safetensors": path}) as server, open_checkpoint(f"{server.url}/a.safetensors") as ckpt:
        a = next(t for t in ckpt.tensors if t.name == "a")
        server.reset()
        got = np.concatenate([c.copy() for c in ckpt.chunks(a, 1 << 20)])
        np.testing.assert_array_equal(got, values)
        first = a.location.offset
        assert server.requests == [("GET", "/a.safetensors", f"bytes={first}-{first + (12 << 20) - 1}")]
        assert server.sent == 12 << 20  # nothing of b
        assert server.connections == 1


class _Squares:
    """A kernel: the sum of squares of each tensor's chunks, by offset (the same whichever worker reads which)."""

    def __init__(self) -> None:
        self.parts: dict[tuple[str, int], float] = {}

    def chunk(self, t, offset: int, values: np.ndarray) -> None:
        self.parts[(t.name, offset)] = float(np.sum(np.square(values, dtype=np.float64)))

    def result(self) -> dict[tuple[str, int], float]:
        return self.parts


def test_two_workers_read_on_in_halves_of_their_own_on_two_connections(tmp_path):
    # one ranged GET is received by one thread at a time: two workers each read on in a half of the tensors' bytes
    # (engine.in_parts), a GET and a connection each, received by two cores at once, no byte asked twice
    from clipcli.checkpoint import engine

    path = tmp_path / "a.safetensors"
    rng = np.random.default_rng(4)
    values = {f"t{i}": rng.standard_normal(5 << 20 >> 2).astype(np.float32) for i in range(7)}  # 7 x 5 MiB
    save_file(values, str(path))
    with range_server({"a.safetensors": path}) as server, open_checkpoint(f"{server.url}/a.safetensors") as ckpt:
        server.reset()
        parts = engine.run(ckpt, ckpt.tensors, _Squares, jobs=2, kind="threads", unit=1)
        first = min(t.location.offset for t in ckpt.tensors)
        end = max(t.location.offset + t.nbytes for t in ckpt.tensors)
        asked = sorted(tuple(int(n) for n in r.removeprefix("bytes=").split("-")) for _, _, r in server.requests)
    assert len(asked) == 2 and server.connections == 2  # the header's, then one more
    (a, b), (c, d) = asked
    assert a == first and c == b + 1 and d == end - 1 and abs((b + 1 - a) - (d + 1 - c)) <= 4 << 20
    sums: dict[str, float] = {}
    for part in parts:
        for (name, _), v in part.items():
            sums[name] = sums.get(name, 0.0) + v
    assert sums == pytest.approx({k: float(np.sum(np.square(v, dtype=np.float64))) for k, v in values.items()})
    assert len(parts) == 2 and all(parts)


def test_a_stream_no_read_comes_back_to_is_given_up(tmp_path, monkeypatch):
    # read-ahead: a read past a stream's place waits for the thread reading the bytes before it, then gives it up
    monkeypatch.setattr(_remote, "_WAIT_S", 0.05)
    path = tmp_path / "a.bin"
    data = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    with range_server({"a.bin": path}) as server:
        store, url = _remote.open_store(f"{server.url}/a.bin")
        try:
            source = store.source(url)
            server.reset()
            reads = [(1 << 20, 1 << 20), (3 << 20, 1 << 19), (7 << 19, 1 << 19)]  # the 2nd MiB is never read
            for offset, n in reads:
                buf = bytearray(n)
                assert source.read_within(offset, memoryview(buf), 4 << 20) == n
                assert bytes(buf) == data[offset : offset + n].tobytes()
            assert [r for _, _, r in server.requests] == [f"bytes={o}-{(4 << 20) - 1}" for o, _ in reads[:2]]
            assert server.connections == 2
        finally:
            store.close()


def test_a_failure_that_persists_is_one_input_error(tmp_path, quick):
    path = tmp_path / "a.safetensors"
    save_file({"a": np.ones(1 << 18, np.float32)}, str(path))
    with range_server({"a.safetensors": path}) as server, open_checkpoint(f"{server.url}/a.safetensors") as ckpt:
        server.fail = ["503"] * _remote.ATTEMPTS
        with pytest.raises(InputError) as raised:
            ckpt.read(ckpt.tensors[0])
        assert raised.value.status == ExitStatus.BAD_INPUT
        assert "503" in str(raised.value) and "\n" not in str(raised.value)
        assert not server.fail  # every try was made


def test_a_url_with_a_space_is_sent_percent_encoded(tmp_path):
    with range_server({"a%20b.safetensors": SAMPLES / "grads.safetensors"}) as server:
        with open_checkpoint(f"{server.url}/a b.safetensors") as ckpt:
            assert len(ckpt.tensors) == 17
        assert {path for _, path, _ in server.requests} == {"/a%20b.safetensors"}


def test_redirects_are_followed_on_the_connection_kept_open(tmp_path):
    # httpfs's own HTTP/1.1 client (http.client, email and ssl took a tenth of a URL run's start-up to import)
    with range_server({"grads.safetensors": SAMPLES / "grads.safetensors"}) as server:
        server.routes["/moved"] = (302, {"Location": "/grads.safetensors"}, b"moved")
        server.routes["/old"] = (301, {"Location": f"{server.url}/moved"}, b"")
        with open_checkpoint(SAMPLES / "grads.safetensors") as ckpt:
            expected = contents(ckpt)
        with open_checkpoint(f"{server.url}/old") as ckpt:
            assert contents(ckpt)[1:] == expected[1:]
        assert [p for _, p, _ in server.requests[:3]] == ["/old", "/moved", "/grads.safetensors"]
        assert server.connections == 1


def test_an_answer_that_closes_its_connection_is_not_sent_on_again(tmp_path, monkeypatch):
    waits = []
    monkeypatch.setattr(_remote.time, "sleep", waits.append)  # a request sent on a closed connection is retried
    with range_server({"grads.safetensors": SAMPLES / "grads.safetensors"}) as server:
        server.routes["/moved"] = (302, {"Location": "/grads.safetensors", "Connection": "close"}, b"")
        with open_checkpoint(f"{server.url}/moved") as ckpt:
            assert len(ckpt.tensors) == 17
        asked = [("HEAD", "/moved"), ("HEAD", "/grads.safetensors"), ("GET", "/moved"), ("GET", "/grads.safetensors")]
        assert [(m, p) for m, p, _ in server.requests] == asked
        assert server.connections == 3  # each redirect's closed by the server
    assert waits == []


def test_an_http_url_is_read_without_http_client_email_or_ssl(tmp_path):
    code = (
        "import sys\n"
        "from clipcli.checkpoint import open_checkpoint\n"
        "with open_checkpoint(sys.argv[1]) as c:\n"
        "    c.read(c.tensors[0])\n"
        "print(sorted(m for m in ('http.client', 'email', 'ssl', 'logging', 'encodings.idna') if m in sys.modules))"
    )
    with range_server({"grads.safetensors": SAMPLES / "grads.safetensors"}) as server:
        url = f"{server.url}/grads.safetensors"
        done = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_missing_url_is_a_missing_file(tmp_path):
    with range_server({}) as server, pytest.raises(MissingFileError) as raised:
        open_checkpoint(f"{server.url}/nothing.safetensors")
    assert str(raised.value) == f"{server.url}/nothing.safetensors: no such file or directory"


def test_a_server_that_ignores_ranges_is_refused(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"a": np.ones(1 << 18, np.float32)}, str(path))
    with range_server({"a.safetensors": path}) as server:
        server.ignore_range = True
        with pytest.raises(InputError, match="does not honour range requests"):
            open_checkpoint(f"{server.url}/a.safetensors")


def test_an_unknown_protocol_is_a_usage_error():
    pytest.importorskip("fsspec")
    with pytest.raises(UsageError, match=r"no reader knows the protocol nosuch://"):
        open_checkpoint("nosuch://bucket/a.safetensors")


@pytest.mark.parametrize(("blocked", "url"), [("fsspec", "s3://b/a.safetensors"), ("s3fs", "s3://b/a.safetensors")])
def test_a_url_without_its_package_is_a_usage_error_naming_what_to_install(blocked, url):
    # (an https:// URL needs no package: tests/cli/test_remote.py reads one with fsspec blocked)
    if blocked != "fsspec":
        pytest.importorskip("fsspec")
    code = (
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "from clipcli.checkpoint import open_checkpoint\n"
        "from clipcli.errors import UsageError\n"
        f"try: open_checkpoint({url!r})\n"
        "except UsageError as e: print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"{url}: reading {url.split(':')[0]}:// URLs needs {blocked}: pip install 'clipcli[remote]'"
    )


def test_a_dcp_directory_and_a_sharded_directory_are_followed_where_the_protocol_lists(tmp_path):
    pytest.importorskip("fsspec")
    # the local file system through fsspec ("file://"): a protocol that lists, as S3 and the Hub do
    shutil.copytree(DATA / "dcp" / "sharded", tmp_path / "dcp")
    shutil.copytree(SAMPLES / "sharded", tmp_path / "shards")
    for name in ("dcp", "shards"):
        with open_checkpoint(tmp_path / name) as ckpt:
            expected = contents(ckpt)
        with open_checkpoint(f"file://{tmp_path / name}") as ckpt:
            assert contents(ckpt) == expected
            assert isinstance(ckpt.store, _remote.RemoteStore)


def test_the_url_of_a_path_inside_clipcli(tmp_path):
    store, path = _remote.open_store("https://host:8080/a/b/m.safetensors")  # nothing asked of the host yet
    assert store.url(path) == "https://host:8080/a/b/m.safetensors"
    assert store.url(path.parent / "x.safetensors") == "https://host:8080/a/b/x.safetensors"
    assert json.dumps(str(path)) == '"https:/host:8080/a/b/m.safetensors"'


# issue 26: names from an index or a `.metadata` were joined to the URL unencoded: `a b#1.safetensors` was asked as
# `/shsp/a%20b` (`#` taken for a fragment), `c%20d?.safetensors` as `/shsp/c%20d?.safetensors` (`?` for a query)
NAMES = ["a b#1.safetensors", "c%20d?.safetensors", "e%.safetensors"]


def test_shard_names_from_an_index_are_percent_encoded_in_the_url(tmp_path):
    local = tmp_path / "shsp"
    local.mkdir()
    weight_map = {}
    for i, name in enumerate(NAMES):
        save_file({f"t{i}": np.arange(5 + i, dtype=np.float32) * (i + 1)}, str(local / name))
        weight_map[f"t{i}"] = name
    (local / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    files = {f"shsp/{quote(p.name)}": p for p in local.iterdir()}
    with open_checkpoint(local / "model.safetensors.index.json") as ckpt:
        expected = contents(ckpt)
    for typed in ("shsp/model.safetensors.index.json", "shsp", "shsp/"):
        with range_server(files) as server, open_checkpoint(f"{server.url}/{typed}") as ckpt:
            assert contents(ckpt) == expected
            asked = {path for _, path, _ in server.requests}
        assert {f"/shsp/{quote(name)}" for name in NAMES} <= asked
        assert {path for path in asked if path.lstrip("/") not in files} <= {"/shsp", "/shsp/", "/shsp/.metadata"}


def test_distcp_names_from_a_metadata_are_percent_encoded_in_the_url(tmp_path):
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    for name in ("a b#?%.distcp", "__0_0.distcp"):
        local = dcp_checkpoint(tmp_path / name, {"w": ((3, 4), [((0, 0), values)])}, file=name)
        with open_checkpoint(local) as ckpt:
            expected = contents(ckpt)
        files = {f"d%25x/{quote(p.name)}": p for p in local.iterdir()}
        with range_server(files) as server, open_checkpoint(f"{server.url}/d%25x/") as ckpt:
            assert contents(ckpt) == expected
            asked = {path for _, path, _ in server.requests}
        assert f"/d%25x/{quote(name)}" in asked
        assert {path for path in asked if path.lstrip("/") not in files} == {"/d%25x/"}  # the directory itself


@pytest.mark.parametrize(
    ("head", "length"),
    [
        (b"HTTP/1.1 2\xb206 Partial\r\nContent-Length: 4\r\n\r\n", "refused"),  # '²': str.isdigit, not int()
        (b"HTTP/1.1 " + b"2" * 5000 + b" OK\r\nContent-Length: 4\r\n\r\n", "refused"),
        (b"HTTP/1.1 206 Partial\r\nContent-Length: 1\xb2\r\n\r\n", None),
        (b"HTTP/1.1 206 Partial\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n", None),  # past int()'s digits
        (b"HTTP/1.1 206 Partial\r\nContent-Length: 4\r\n\r\n", 4),
    ],
)
def test_numbers_a_server_sends_are_ascii_digits_of_sane_length(head, length):
    # review 28: a status or a Content-Length of '²' or of 5,000 digits raised ValueError in int() (exit 70)
    import socket

    from clipcli.checkpoint.httpfs import _Connection

    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(head)
        connection = _Connection("http", "127.0.0.1")
        connection.sock = ours
        if length == "refused":
            with pytest.raises(ConnectionError, match=r"not an HTTP/1\.x answer"):
                connection.answer("GET")
        else:
            assert connection.answer("GET").length == length
