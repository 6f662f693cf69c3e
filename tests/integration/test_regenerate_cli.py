"""`dflash-train regenerate` end to end: a fake OpenAI-compatible server on 127.0.0.1 started by
the tests, and the local back end on a tiny random target."""

from __future__ import annotations

import email.utils
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_train.cli import main as cli
from dflash_train.data.synthetic import write_jsonl


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A client that timed out has closed its socket: writing the late answer then fails.
        pass


class FakeServer:
    """Chat completions whose answer is a pure function of the request: "echo <number of
    messages>: <last message>". Failure modes are set on the instance while it runs; `script`,
    when set, is asked for each completion request (its 1-based number and body) and returns
    an action: "status" (answers that HTTP error), "headers" (sent with it), "finish_reason",
    "content" (the answer's text), "delay" (seconds before answering), "hang" (no answer until
    `release` is set, then the usual one), "trickle" (the usual answer, one byte every that many
    seconds; with "stall_after", that many bytes, then none until `release` is set).

    It is also an HTTP proxy: a request for a whole URL (http://host/v1/...) is answered as if
    it were for its path, and counted in `proxied`; a CONNECT is recorded in `connects` and
    refused (403). `proxy_auth` records each Proxy-Authorization header."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bodies: list[dict] = []
        self.fail_first = 0  # the first N completion requests get HTTP 500
        self.fail_after: int | None = None  # after N successes every request gets HTTP 500
        self.bad_request_marker: str | None = None  # prompts containing it get HTTP 400
        self.delay_first = 0.0  # seconds the first completion request waits before answering
        self.reasoning: str | None = None
        self.token_ids = "none"  # when asked for ids: "ids" returns them, "bad" other things,
        # "refuse" answers 400
        self.successes = 0
        self.script = None
        self.times: list[float] = []  # when each completion request arrived (time.monotonic)
        self.models_status = 200  # GET /models answers this
        self.model_listings = 0
        self.release = threading.Event()  # ends every "hang" (set when the test ends)
        self.proxied = 0
        self.connects: list[str] = []
        self.proxy_auth: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def parse_request(self):
                if not super().parse_request():
                    return False
                if self.headers.get("Proxy-Authorization"):
                    server.proxy_auth.append(self.headers["Proxy-Authorization"])
                if self.path.startswith("http://"):  # asked as a proxy
                    with server.lock:
                        server.proxied += 1
                    self.path = urllib.parse.urlsplit(self.path).path
                return True

            def do_CONNECT(self):
                server.connects.append(self.path)
                self._send(403, {"error": "no tunnels here"})

            def do_GET(self):
                if self.path == "/v1/models":
                    with server.lock:
                        server.model_listings += 1
                    if server.models_status != 200:
                        self._send(server.models_status, {"error": "no"})
                        return
                    self._send(200, {"object": "list", "data": [{"id": "tiny"}]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, payload, action = server.respond(body)
                if action.get("trickle"):
                    self._trickle(payload, action["trickle"], action.get("stall_after"))
                else:
                    self._send(status, payload, action.get("headers", {}))

            def _send(self, status, payload, headers=None):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def _trickle(self, payload, every, stall_after=None):
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.flush()
                for i, byte in enumerate(data):
                    if i == stall_after:
                        server.release.wait(60)
                        return
                    if server.release.wait(every):
                        return
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-openai"
        )

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def respond(self, body: dict) -> tuple[int, dict, dict]:
        with self.lock:
            self.bodies.append(body)
            self.times.append(time.monotonic())
            n = len(self.bodies)
            delay = self.delay_first if n == 1 and self.delay_first else 0.0
            failing = n <= self.fail_first or (
                self.fail_after is not None and self.successes >= self.fail_after
            )
            last = body["messages"][-1]["content"]
            bad = self.bad_request_marker is not None and self.bad_request_marker in last
            if not failing and not bad:
                self.successes += 1
        action = (self.script(n, body) if self.script is not None else None) or {}
        time.sleep(delay + action.get("delay", 0.0))
        if action.get("hang"):
            self.release.wait(60)
        if bad:
            return 400, {"error": "prompt rejected"}, {}
        if body.get("return_token_ids") and self.token_ids == "refuse":
            return 400, {"error": "Unrecognized request argument supplied: return_token_ids"}, {}
        if failing:
            return 500, {"error": "overloaded"}, {}
        if "status" in action:
            return action["status"], {"error": f"scripted {action['status']}"}, action
        message = {"role": "assistant", "content": action.get("content", answer(body["messages"]))}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        choice = {"message": message, "finish_reason": action.get("finish_reason", "stop")}
        if body.get("return_token_ids") and self.token_ids in ("ids", "bad"):
            ids = fake_ids(message["content"])
            choice["token_ids"] = ids if self.token_ids == "ids" else [*ids[:-1], "2"]
        return 200, {"choices": [choice]}, action

    def completions(self) -> int:
        with self.lock:
            return len(self.bodies)


def answer(messages: list[dict]) -> str:
    return f"echo {len(messages)}: {messages[-1]['content']}"


def fake_ids(text: str) -> list[int]:
    """The fake model's "generated ids": its text's bytes, then a stop token (id 2)."""
    return [*text.encode(), 2]


@pytest.fixture
def server():
    s = FakeServer()
    s.thread.start()
    yield s
    s.release.set()
    s.httpd.shutdown()
    s.httpd.server_close()
    s.thread.join(timeout=10)


def prompts_file(path, n, marker_row=None):
    rows = [{"prompt": f"question {i}"} for i in range(n)]
    if marker_row is not None:
        rows[marker_row] = {"prompt": "question BAD"}
    return write_jsonl(rows, path)


def regenerate(data, out, *extra):
    return cli(["regenerate", "--data", str(data), "--out", str(out), *map(str, extra)])


def read_out(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


FAST_RETRY = ("--retry-delay", 0.01, "--request-timeout", 10)


def test_server_rewrites_every_answer_and_keeps_the_prompts(server, tmp_path):
    conversations = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old"}]},
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "one"},
                {"from": "gpt", "value": "old"},
                {"from": "human", "value": "two"},
                {"from": "gpt", "value": "old"},
            ]
        },
        {"prompt": "just a prompt"},
    ] * 4
    data = write_jsonl(conversations, tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    assert regenerate(data, out, "--endpoint", server.endpoint, "--concurrency", 3) == 0
    rows = sorted(read_out(out), key=lambda r: r["source_line"])
    assert [r["source_line"] for r in rows] == list(range(1, 13))
    two_turns = rows[1]["messages"]
    assert [m["role"] for m in two_turns] == ["system", "user", "assistant", "user", "assistant"]
    # Each answer is generated from the conversation as regenerated so far.
    first = answer(two_turns[:2])
    assert two_turns[2]["content"] == first
    assert two_turns[4]["content"] == answer(two_turns[:4])
    assert rows[1]["finish_reasons"] == ["stop", "stop"]
    assert rows[2]["messages"][-1]["content"] == "echo 1: just a prompt"
    assert all("old" not in json.dumps(r["messages"]) for r in rows)
    body = server.bodies[0]
    assert body["model"] == "tiny" and body["temperature"] == 0.0
    assert body["max_tokens"] == 2048 and "chat_template_kwargs" not in body
    assert server.completions() == 16


def test_last_mode_regenerates_only_the_final_answer(server, tmp_path):
    row = {
        "messages": [
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "kept"},
            {"role": "user", "content": "two"},
            {"role": "assistant", "content": "old"},
        ]
    }
    data = write_jsonl([row], tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    assert regenerate(data, out, "--endpoint", server.endpoint, "--turns", "last") == 0
    messages = read_out(out)[0]["messages"]
    assert [m["content"] for m in messages] == ["one", "kept", "two", "echo 3: two"]


def test_transient_server_errors_are_retried(server, tmp_path):
    server.fail_first = 3
    data = prompts_file(tmp_path / "in.jsonl", 4)
    out = tmp_path / "out.jsonl"
    rc = regenerate(data, out, "--endpoint", server.endpoint, "--concurrency", 1, *FAST_RETRY)
    assert rc == 0
    assert sorted(r["source_line"] for r in read_out(out)) == [1, 2, 3, 4]
    assert server.completions() == 4 + 3


def test_interrupted_run_resumes_without_losing_or_duplicating_rows(server, tmp_path, capsys):
    server.fail_after = 5
    data = prompts_file(tmp_path / "in.jsonl", 12)
    out = tmp_path / "out.jsonl"
    args = ("--endpoint", server.endpoint, "--concurrency", 3, "--max-retries", 1, *FAST_RETRY)
    assert regenerate(data, out, *args) == 1
    assert "re-run the same command to resume" in capsys.readouterr().err
    first = out.read_text().splitlines()
    assert len(first) == 5
    server.fail_after = None
    before = server.completions()
    assert regenerate(data, out, *args) == 0
    rows = read_out(out)
    assert set(first) <= set(out.read_text().splitlines())  # kept as they were written
    # Every row done: the file is put in input order.
    assert [r["source_line"] for r in rows] == list(range(1, 13))
    for r in rows:
        assert r["messages"][-1]["content"] == f"echo 1: question {r['source_line'] - 1}"
    # The second run asked only for the 7 missing rows. (The first one stopped without waiting
    # for its requests on the wire, at most one per worker: they may reach the server late.)
    written = {json.loads(line)["source_line"] for line in first}
    missing = {f"question {r['source_line'] - 1}" for r in rows if r["source_line"] not in written}
    asked = [b["messages"][-1]["content"] for b in server.bodies[before:]]
    assert set(asked) == missing and len(missing) == 7
    assert 7 <= len(asked) <= 7 + 3


def test_a_partly_written_last_row_is_redone_once(server, tmp_path):
    data = prompts_file(tmp_path / "in.jsonl", 5)
    out = tmp_path / "out.jsonl"
    assert regenerate(data, out, "--endpoint", server.endpoint) == 0
    complete = out.read_text()
    last = complete.splitlines()[-1]
    out.write_text(complete[: len(complete) - len(last) // 2])  # crash mid-write
    assert regenerate(data, out, "--endpoint", server.endpoint) == 0
    rows = read_out(out)
    assert sorted(r["source_line"] for r in rows) == [1, 2, 3, 4, 5]
    assert rows[-1] == json.loads(last)


def test_other_settings_are_refused_unless_overwrite(server, tmp_path, capsys):
    data = prompts_file(tmp_path / "in.jsonl", 3)
    out = tmp_path / "out.jsonl"
    assert regenerate(data, out, "--endpoint", server.endpoint) == 0
    assert regenerate(data, out, "--endpoint", server.endpoint, "--temperature", 0.7) == 2
    assert "temperature differ" in capsys.readouterr().err
    hot = ("--endpoint", server.endpoint, "--temperature", 0.7, "--overwrite")
    assert regenerate(data, out, *hot) == 0
    rows = read_out(out)
    assert len(rows) == 3 and all(r["regenerated_with"]["temperature"] == 0.7 for r in rows)


def test_thinking_is_sent_to_the_template_and_reasoning_comes_back_inline(server, tmp_path):
    server.reasoning = "thinking hard"
    data = prompts_file(tmp_path / "in.jsonl", 1)
    out = tmp_path / "out.jsonl"
    assert regenerate(data, out, "--endpoint", server.endpoint, "--thinking", "on") == 0
    assert server.bodies[0]["chat_template_kwargs"] == {"enable_thinking": True}
    content = read_out(out)[0]["messages"][-1]["content"]
    assert content == "<think>\nthinking hard\n</think>\n\necho 1: question 0"


def test_a_server_that_returns_the_generated_ids_has_them_written_for_every_turn(server, tmp_path):
    server.token_ids = "ids"
    data = write_jsonl(
        [
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "old"},
                    {"role": "user", "content": "b"},
                ]
            }
        ],
        tmp_path / "in.jsonl",
    )
    out = tmp_path / "out.jsonl"
    assert regenerate(data, out, "--endpoint", server.endpoint) == 0
    assert all(b["return_token_ids"] is True for b in server.bodies)
    row = read_out(out)[0]
    answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
    assert row["token_ids"] == [fake_ids(a) for a in answers] and len(answers) == 2


def test_ids_are_not_written_for_reasoning_the_server_split_out(server, tmp_path):
    server.token_ids, server.reasoning = "ids", "thinking hard"
    data = prompts_file(tmp_path / "in.jsonl", 2)
    out = tmp_path / "out.jsonl"
    assert regenerate(data, out, "--endpoint", server.endpoint, "--thinking", "on") == 0
    assert all("token_ids" not in row for row in read_out(out))


def test_ids_that_are_not_token_ids_fail_the_row_in_one_line(server, tmp_path, capsys):
    server.token_ids = "bad"
    data = prompts_file(tmp_path / "in.jsonl", 1)
    assert regenerate(data, tmp_path / "out.jsonl", "--endpoint", server.endpoint) != 0
    assert "token_ids is not a list of token ids" in capsys.readouterr().err


def test_a_server_that_refuses_the_ids_field_is_asked_for_text_only(server, tmp_path):
    server.token_ids = "refuse"
    data = prompts_file(tmp_path / "in.jsonl", 3)
    out = tmp_path / "out.jsonl"
    args = ("--endpoint", server.endpoint, "--concurrency", 1, *FAST_RETRY)
    assert regenerate(data, out, *args) == 0
    rows = read_out(out)
    assert len(rows) == 3 and all("token_ids" not in row for row in rows)
    asked = [b.get("return_token_ids", False) for b in server.bodies]
    assert asked == [True, False, False, False]  # refused once, then never sent again


def test_client_errors_are_not_retried_and_skip_mode_goes_on(server, tmp_path, capsys):
    server.bad_request_marker = "BAD"
    data = prompts_file(tmp_path / "in.jsonl", 4, marker_row=1)
    out = tmp_path / "out.jsonl"
    args = ("--endpoint", server.endpoint, "--on-error", "skip", *FAST_RETRY)
    # Regression: exit status 0 with rows missing (even with every row failed).
    assert regenerate(data, out, *args) == 1
    assert sorted(r["source_line"] for r in read_out(out)) == [1, 3, 4]
    assert server.completions() == 4  # the 400 was not retried
    said = capsys.readouterr()
    assert "in.jsonl:2: HTTP 400" in said.out
    last = said.err.strip().splitlines()[-1]
    assert "1 row(s) failed" in last and "re-run the same command to retry them" in last
    server.bad_request_marker = None
    assert regenerate(data, out, *args) == 0  # the same command retries it


def test_skip_lists_ten_failed_rows_and_counts_the_rest(server, tmp_path, capsys):
    server.bad_request_marker = "question"
    data = prompts_file(tmp_path / "in.jsonl", 13)
    args = ("--endpoint", server.endpoint, "--on-error", "skip", *FAST_RETRY)
    assert regenerate(data, tmp_path / "out.jsonl", *args) == 1
    said = capsys.readouterr()
    listed = [ln for ln in said.out.splitlines() if "in.jsonl:" in ln]
    assert [ln.split(":")[1] for ln in listed] == [str(i) for i in range(1, 11)]
    assert "  ... and 3 more" in said.out.splitlines()
    assert "13 row(s) failed" in said.err.strip().splitlines()[-1]


@pytest.mark.parametrize("on_error", ["fail", "skip"])
@pytest.mark.parametrize(
    ("status", "hint"),
    [(401, "check OPENAI_API_KEY"), (403, "check OPENAI_API_KEY"), (404, "check --endpoint")],
)
def test_credentials_url_and_model_refusals_stop_the_run_at_once(
    server, tmp_path, capsys, on_error, status, hint
):
    """Regression: under skip every row was sent and failed alike, exit 0; under fail the
    message said "re-run the same command to resume", which cannot help."""
    server.script = lambda n, body: {"status": status}
    data = prompts_file(tmp_path / "in.jsonl", 12)
    args = ("--endpoint", server.endpoint, "--concurrency", 2, "--on-error", on_error)
    assert regenerate(data, tmp_path / "out.jsonl", *args, *FAST_RETRY) == 2
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and f"HTTP {status}" in errors[0] and hint in errors[0], err
    assert "re-run" not in err
    assert server.completions() <= 2  # the requests already sent, nothing more


def test_a_refused_model_listing_asks_for_the_key_not_for_model(server, tmp_path, capsys):
    server.models_status = 401
    data = prompts_file(tmp_path / "in.jsonl", 1)
    assert regenerate(data, tmp_path / "out.jsonl", "--endpoint", server.endpoint) == 2
    err = capsys.readouterr().err
    assert "HTTP 401" in err and "check OPENAI_API_KEY" in err and "pass --model" not in err


def test_a_request_that_times_out_is_retried(server, tmp_path):
    server.delay_first = 2.0
    data = prompts_file(tmp_path / "in.jsonl", 2)
    out = tmp_path / "out.jsonl"
    start = time.monotonic()
    args = ("--endpoint", server.endpoint, "--request-timeout", 0.3, "--retry-delay", 0.01)
    assert regenerate(data, out, *args, "--concurrency", 1) == 0
    assert time.monotonic() - start < 2.0
    assert sorted(r["source_line"] for r in read_out(out)) == [1, 2]


def test_a_trickled_answer_is_timed_out_and_retried(server, tmp_path):
    """Regression: --request-timeout bounded each socket read, so an answer sent a byte at a
    time was waited on for as long as it took."""
    server.script = lambda n, body: {"trickle": 0.1} if n == 1 else {}  # ~8 s for the body
    data = prompts_file(tmp_path / "in.jsonl", 1)
    out = tmp_path / "out.jsonl"
    args = ("--endpoint", server.endpoint, "--request-timeout", 1, "--retry-delay", 0.01)
    start = time.monotonic()
    assert regenerate(data, out, *args) == 0
    assert time.monotonic() - start < 4.0
    assert server.completions() == 2
    assert read_out(out)[0]["messages"][-1]["content"] == "echo 1: question 0"


def test_an_answer_that_stalls_mid_body_is_timed_out_at_the_deadline(server, tmp_path):
    """--request-timeout bounds the whole attempt: a body that stops arriving after a second is
    given up at the deadline, not a full --request-timeout after its last byte."""
    server.script = lambda n, body: {"trickle": 0.25, "stall_after": 4} if n == 1 else {}
    data = prompts_file(tmp_path / "in.jsonl", 1)
    out = tmp_path / "out.jsonl"
    args = ("--endpoint", server.endpoint, "--request-timeout", 1.5, "--retry-delay", 0.01)
    assert regenerate(data, out, *args) == 0
    first, second = server.times
    assert 1.4 <= second - first < 2.2, second - first  # not 1 s of bytes + 1.5 s of silence
    assert read_out(out)[0]["messages"][-1]["content"] == "echo 1: question 0"


def test_an_empty_answer_fails_its_row_without_a_retry(server, tmp_path, capsys):
    """Regression: an answer with no text (finish_reason "stop", content "") was written as the
    row's answer, and prepare dropped the row later without a word."""
    server.script = lambda n, body: {"content": ""} if n == 1 else {}
    data = prompts_file(tmp_path / "in.jsonl", 2)
    out = tmp_path / "out.jsonl"
    args = ("--endpoint", server.endpoint, "--concurrency", 1, *FAST_RETRY)
    assert regenerate(data, out, *args, "--on-error", "skip") == 1
    assert server.completions() == 2  # one each: the empty one is not asked again
    printed = capsys.readouterr()
    assert "in.jsonl:1: the answer is empty (finish_reason 'stop')" in printed.out + printed.err
    assert [row["source_line"] for row in read_out(out)] == [2]


def test_a_failed_row_under_fail_stops_the_run_without_waiting_for_the_wire(
    server, tmp_path, capsys
):
    """Regression: under --on-error fail a failed row stopped new requests, then waited for
    every request on the wire (up to --request-timeout) before the run ended."""

    def script(n, body):
        prompt = body["messages"][-1]["content"]
        if prompt == "question 0":
            return {}
        if prompt == "question 1":
            return {"status": 400, "delay": 0.3}  # after row 1 is back
        return {"hang": True}  # until released

    server.script = script
    data = prompts_file(tmp_path / "in.jsonl", 8)
    out = tmp_path / "out.jsonl"
    args = ("--endpoint", server.endpoint, "--concurrency", 4, "--request-timeout", 20)
    start = time.monotonic()
    assert regenerate(data, out, *args, "--retry-delay", 0.01) == 1
    assert time.monotonic() - start < 5.0
    assert "in.jsonl:2: HTTP 400" in capsys.readouterr().err
    assert out.read_text().endswith("\n")
    assert [r["source_line"] for r in read_out(out)] == [1]
    sent = server.completions()
    assert sent <= 5  # rows 1 to 4, and row 5 after row 1: nothing after the failure
    time.sleep(0.6)
    assert server.completions() == sent
    server.script = None
    server.release.set()
    assert regenerate(data, out, "--endpoint", server.endpoint) == 0
    assert [r["source_line"] for r in read_out(out)] == list(range(1, 9))


def test_the_proxy_the_environment_names_carries_the_requests(server, tmp_path, monkeypatch):
    """http_proxy, https_proxy and no_proxy are honoured, as urllib honours them."""
    port = server.httpd.server_address[1]
    monkeypatch.setenv("http_proxy", f"http://me:p%40ss@127.0.0.1:{port}")
    monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{port}")
    data = prompts_file(tmp_path / "in.jsonl", 2)
    fast = ("--max-retries", 0, "--request-timeout", 5)
    # An unresolvable host: only the proxy can reach it.
    plain = ("--endpoint", "http://regen.invalid/v1", *fast)
    assert regenerate(data, tmp_path / "a.jsonl", *plain) == 0
    assert server.proxied == 1 + 2  # the model listing, then the rows
    assert set(server.proxy_auth) == {"Basic bWU6cEBzcw=="}  # me:p@ss
    https = ("--endpoint", "https://regen.invalid:8443/v1", *fast)
    assert regenerate(data, tmp_path / "b.jsonl", *https) == 2
    assert server.connects == ["regen.invalid:8443"]  # tunnelled (and refused by this proxy)
    monkeypatch.setenv("no_proxy", "regen.invalid")
    assert regenerate(data, tmp_path / "c.jsonl", *plain) == 2  # direct: no such host
    assert server.proxied == 3 and len(server.connects) == 1


def test_a_thousand_retries_do_not_overflow_the_back_off(server, tmp_path, capsys):
    """Regression: `retry_delay * 2**attempt` was computed before the 60 s cap, and past 1023
    retries it overflowed a float (OverflowError, a traceback)."""
    server.fail_first = 10**6
    data = prompts_file(tmp_path / "in.jsonl", 1)
    args = ("--endpoint", server.endpoint, "--model", "tiny", "--concurrency", 1)
    args += ("--max-retries", 1030, "--retry-delay", 0)
    assert regenerate(data, tmp_path / "out.jsonl", *args) == 1
    assert "HTTP 500" in capsys.readouterr().err
    assert server.completions() == 1031


def test_retry_after_is_waited_for_in_seconds_and_as_a_date(server, tmp_path):
    """Regression: a 429 or 503 answer's Retry-After was ignored (retried after --retry-delay)."""

    def script(n, body):
        if n == 1:
            return {"status": 429, "headers": {"Retry-After": "1"}}
        if n == 2:
            when = email.utils.formatdate(time.time() + 2, usegmt=True)
            return {"status": 503, "headers": {"Retry-After": when}}
        return {}

    server.script = script
    data = prompts_file(tmp_path / "in.jsonl", 1)
    args = ("--endpoint", server.endpoint, "--concurrency", 1, *FAST_RETRY)
    assert regenerate(data, tmp_path / "out.jsonl", *args) == 0
    first, second, third = server.times
    assert second - first >= 0.95  # Retry-After: 1, not --retry-delay 0.01
    assert third - second >= 0.95  # an HTTP date 1 to 2 s ahead (whole seconds)


@pytest.mark.parametrize("reason", ["abort", "content_filter", "tool_calls", "interrupted"])
def test_an_answer_the_server_ended_otherwise_is_retried_then_fails(
    server, tmp_path, capsys, reason
):
    """Regression: a finish_reason other than "stop" or "length" (vLLM's "abort": a request it
    cancelled, its answer cut short) was written as a finished answer."""
    server.script = lambda n, body: {"finish_reason": reason} if n == 1 else {}
    data = prompts_file(tmp_path / "in.jsonl", 1)
    out = tmp_path / "out.jsonl"
    args = ("--endpoint", server.endpoint, "--concurrency", 1, *FAST_RETRY)
    assert regenerate(data, out, *args) == 0  # retried, then answered
    assert server.completions() == 2
    assert read_out(out)[0]["finish_reasons"] == ["stop"]
    server.script = lambda n, body: {"finish_reason": reason}
    out2 = tmp_path / "out2.jsonl"
    assert regenerate(data, out2, *args, "--max-retries", 1) == 1
    assert f"finish_reason {reason!r}" in capsys.readouterr().err
    assert out2.read_text() == ""


def test_a_finished_file_is_in_input_order_whatever_the_timing(server, tmp_path):
    """Regression: rows stayed in completion order, so two identical runs wrote different
    files (and `prepare` made different datasets of them)."""
    data = prompts_file(tmp_path / "in.jsonl", 6)
    args = ("--endpoint", server.endpoint, "--concurrency", 6)
    for name, slow_first in (("a.jsonl", True), ("b.jsonl", False)):

        def script(n, body, slow_first=slow_first):
            i = int(body["messages"][-1]["content"].split()[-1])
            return {"delay": 0.1 * ((6 - i) if slow_first else i)}

        server.script = script
        assert regenerate(data, tmp_path / name, *args) == 0
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert [r["source_line"] for r in read_out(a)] == [1, 2, 3, 4, 5, 6]
    assert a.read_bytes() == b.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "in.jsonl"]
    fresh = tmp_path / "fresh"
    fresh.touch()
    assert a.stat().st_mode == fresh.stat().st_mode  # not mkstemp's owner-only mode


def test_a_resumed_run_that_completes_the_file_puts_it_in_input_order(server, tmp_path):
    server.bad_request_marker = "BAD"
    data = prompts_file(tmp_path / "in.jsonl", 5, marker_row=1)
    out = tmp_path / "out.jsonl"
    args = ("--endpoint", server.endpoint, "--concurrency", 1, "--on-error", "skip")
    assert regenerate(data, out, *args) == 1
    assert [r["source_line"] for r in read_out(out)] == [1, 3, 4, 5]
    server.bad_request_marker = None
    assert regenerate(data, out, *args) == 0
    assert [r["source_line"] for r in read_out(out)] == [1, 2, 3, 4, 5]  # not [1, 3, 4, 5, 2]


def test_a_second_process_on_the_same_out_is_refused_before_any_request(server, tmp_path, capsys):
    """Regression: both appended every row, and the next run called the file corrupt."""
    server.script = lambda n, body: {"hang": True}  # until released
    data = prompts_file(tmp_path / "in.jsonl", 4)
    out = tmp_path / "out.jsonl"
    first: list[int] = []
    running = threading.Thread(
        target=lambda: first.append(regenerate(data, out, "--endpoint", server.endpoint))
    )
    running.start()
    try:
        deadline = time.monotonic() + 30
        while server.completions() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        listings, sent = server.model_listings, server.completions()
        args = ("--endpoint", server.endpoint, "--max-retries", 0, "--request-timeout", 2)
        assert regenerate(data, out, *args) == 2
        err = capsys.readouterr().err
        assert f"--out {out} is being written by another regenerate process" in err
        assert (server.model_listings, server.completions()) == (listings, sent)
    finally:
        server.release.set()
        running.join(timeout=60)
    assert first == [0]
    assert [r["source_line"] for r in read_out(out)] == [1, 2, 3, 4]


def test_ctrl_c_leaves_at_once_and_keeps_the_rows_already_answered(server, tmp_path):
    """Regression: an interrupt waited for the requests on the wire, up to --request-timeout
    (and again at interpreter exit), and threw their answers away. A real process: the
    interpreter's exit is part of it."""
    server.script = lambda n, body: (
        {} if body["messages"][-1]["content"] == "question 0" else {"hang": True}
    )
    data = prompts_file(tmp_path / "in.jsonl", 5)
    out = tmp_path / "out.jsonl"
    argv = ["regenerate", "--data", str(data), "--out", str(out), "--endpoint", server.endpoint]
    argv += ["--concurrency", "2", "--request-timeout", "20"]
    code = "import sys; from dflash_train.cli import main; sys.exit(main(sys.argv[1:]))"
    with (tmp_path / "stderr").open("w") as err:
        proc = subprocess.Popen([sys.executable, "-c", code, *argv], stderr=err)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                if server.completions() >= 3 and out.exists() and out.read_text().count("\n"):
                    break  # row 1 written, rows 2 and 3 on the wire
                time.sleep(0.05)
            time.sleep(0.3)
            sent = time.monotonic()
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=60)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
    assert rc == 130, (tmp_path / "stderr").read_text()
    assert took < 5.0, took
    assert "interrupted" in (tmp_path / "stderr").read_text()
    assert [r["source_line"] for r in read_out(out)] == [1]
    server.script = None
    before = server.completions()
    assert regenerate(data, out, "--endpoint", server.endpoint) == 0
    assert [r["source_line"] for r in read_out(out)] == [1, 2, 3, 4, 5]
    assert server.completions() - before == 4


def test_a_bad_input_line_stops_before_any_request(server, tmp_path, capsys):
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": 3}\n')
    assert regenerate(data, tmp_path / "out.jsonl", "--endpoint", server.endpoint) == 2
    assert "in.jsonl:2: 'prompt' must be a string" in capsys.readouterr().err
    assert server.completions() == 0


def test_an_unreachable_server_is_a_clear_error(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}/v1"
    data = prompts_file(tmp_path / "in.jsonl", 2)
    out = tmp_path / "out.jsonl"
    args = ("--endpoint", endpoint, "--max-retries", 1, "--retry-delay", 0.01)
    assert regenerate(data, out, *args) == 2
    assert "cannot list the models" in capsys.readouterr().err
    assert regenerate(data, out, *args, "--model", "tiny") == 1
    assert "failed" in capsys.readouterr().err
    assert out.read_text() == ""


def test_exactly_one_back_end_is_required(tmp_path, capsys):
    data = prompts_file(tmp_path / "in.jsonl", 1)
    assert regenerate(data, tmp_path / "out.jsonl") == 2
    assert "exactly one back end" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "rule"),
    [
        ("--retry-delay", "nan", ">= 0"),
        ("--retry-delay", "-1", ">= 0"),
        ("--request-timeout", "inf", "> 0"),
        ("--request-timeout", "0", "> 0"),
        ("--temperature", "nan", ">= 0"),
        ("--temperature", "-0.5", ">= 0"),
    ],
)
def test_float_options_must_be_finite_and_in_range(tmp_path, capsys, flag, value, rule):
    data = prompts_file(tmp_path / "in.jsonl", 1)
    endpoint = ("--endpoint", "http://127.0.0.1:9/v1")
    assert regenerate(data, tmp_path / "out.jsonl", *endpoint, flag, value) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"{flag} must be a finite number {rule}, got {float(value)}" in lines[0]
    assert not (tmp_path / "out.jsonl").exists()


# ------------------------------------------------------------------------------ local back end


@pytest.fixture(scope="module")
def local_target(tmp_path_factory):
    """A tokenizer and a random 2-layer Qwen3 whose vocabulary fits it, in one directory."""
    from dflash_train.data.synthetic import corpus_texts, synthetic_conversations
    from dflash_train.data.tokenizer import build_chat_tokenizer
    from dflash_train.model.tiny import save_random_qwen3

    root = tmp_path_factory.mktemp("local_target")
    texts = corpus_texts(synthetic_conversations(200, seed=0))
    tok = build_chat_tokenizer(texts, root, vocab_size=400)
    save_random_qwen3(
        root, hidden_size=32, intermediate_size=64, num_layers=2, head_dim=8, vocab_size=len(tok)
    )
    return root


def test_local_batched_generation_equals_one_row_at_a_time(local_target, tmp_path):
    import torch

    torch.set_num_threads(1)
    rows = [
        {"prompt": "Count from 1 to 5."},
        {"prompt": "Spell the word river, please, slowly and carefully."},
        {
            "messages": [
                {"role": "system", "content": "Be exact."},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "old"},
                {"role": "user", "content": "Reverse this list: red, blue"},
            ]
        },
    ]
    data = write_jsonl(rows, tmp_path / "in.jsonl")
    common = ("--target", local_target, "--max-new-tokens", 6, "--thinking", "off")
    assert regenerate(data, tmp_path / "b3.jsonl", *common, "--batch-size", 3) == 0
    assert regenerate(data, tmp_path / "b1.jsonl", *common, "--batch-size", 1) == 0
    batched = {r["source_line"]: r for r in read_out(tmp_path / "b3.jsonl")}
    single = {r["source_line"]: r for r in read_out(tmp_path / "b1.jsonl")}
    assert batched.keys() == single.keys() == {1, 2, 3}
    for line in (1, 2, 3):
        assert batched[line]["messages"] == single[line]["messages"]
        assert set(batched[line]["finish_reasons"]) <= {"stop", "length"}
    assert [m["role"] for m in batched[3]["messages"]][-2:] == ["user", "assistant"]
    assert len(batched[3]["finish_reasons"]) == 2  # "hi" was answered again, then the last turn
    assert batched[1]["regenerated_with"]["backend"] == "local"


def test_local_target_with_a_smaller_vocabulary_than_the_tokenizer_is_refused(
    local_target, tiny_target, tmp_path, capsys
):
    data = prompts_file(tmp_path / "in.jsonl", 1)
    args = ("--target", tiny_target, "--tokenizer", local_target)
    assert regenerate(data, tmp_path / "out.jsonl", *args) == 2
    assert "do not belong together" in capsys.readouterr().err


def test_local_resume_with_nothing_left_does_not_load_the_model(local_target, tmp_path, capsys):
    import shutil

    target = tmp_path / "target"
    shutil.copytree(local_target, target)
    data = prompts_file(tmp_path / "in.jsonl", 2)
    out = tmp_path / "out.jsonl"
    args = ("--target", target, "--max-new-tokens", 3)
    assert regenerate(data, out, *args) == 0
    (target / "model.safetensors").unlink()  # a load attempt would now fail
    capsys.readouterr()
    assert regenerate(data, out, *args) == 0
    assert "2/2 rows done (0 written now, 2 by earlier runs)" in capsys.readouterr().out
    assert len(read_out(out)) == 2


def test_prepare_trains_the_local_answers_on_the_ids_the_target_generated(
    local_target, tmp_path, capsys
):
    """A random target emits token runs its tokenizer would not give back from their text (odd
    BPE splits, lone bytes): the prepared row is the generation prompt plus exactly the ids the
    target generated, its stop token included, all of them supervised."""
    import torch
    from transformers import AutoTokenizer

    from dflash_train.data.chat import ChatFormat
    from dflash_train.data.dataset import PreparedDataset

    torch.set_num_threads(1)
    data = prompts_file(tmp_path / "in.jsonl", 6)
    out = tmp_path / "regen.jsonl"
    args = ("--target", local_target, "--max-new-tokens", 12, "--thinking", "off")
    assert regenerate(data, out, *args) == 0
    rows = read_out(out)  # the prepared rows follow the file's order
    assert all(len(r["token_ids"]) == len(r["finish_reasons"]) == 1 for r in rows)
    ds_dir = tmp_path / "ds"
    argv = ["prepare", "--data", str(out), "--tokenizer", str(local_target), "--out", str(ds_dir)]
    assert cli([*argv, "--no-enable-thinking"]) == 0
    said = capsys.readouterr().out
    ds = PreparedDataset(ds_dir)
    fmt = ChatFormat(AutoTokenizer.from_pretrained(local_target), enable_thinking=False)
    assert ds.summary["stats"]["answers_from_ids"] == len(rows) == len(ds)
    differ = ds.summary["stats"]["ids_not_in_text"]
    assert f"{len(rows)} last answers trained on their generated ids (the text of {differ}" in said
    for i, row in enumerate(rows):
        ids, mask = ds.row(i)
        prompt = fmt.prompt_ids(row["messages"][:-1])
        generated = row["token_ids"][-1]
        assert ids.tolist() == [*prompt.tolist(), *generated], row
        assert not mask[: len(prompt)].any() and mask[len(prompt) :].all()
        stopped = row["finish_reasons"][-1] == "stop"
        assert (generated[-1] in fmt.stop_token_ids) == stopped
    # The random target's text does not give its ids back (all 6 rows when written): the text
    # path would have trained other tokens than the target generated.
    assert 0 < differ <= len(rows)
    # Prepared with another thinking switch, the ids would follow a prompt they did not follow.
    assert cli([*argv[:-1], str(tmp_path / "other")]) == 2
    assert "generated with thinking off" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("file", "key", "what"),
    [
        ("config.json", "max_position_embeddings", "its max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length", "its tokenizer's model_max_length"),
    ],
)
def test_local_rows_past_the_targets_maximum_length_are_named(
    local_target, tmp_path, capsys, file, key, what
):
    """Regression: transformers' warning that a sequence is too long named no row (and its
    generation warning measured the padded batch)."""
    import logging
    import shutil

    target = tmp_path / "target"
    shutil.copytree(local_target, target)
    config = json.loads((target / file).read_text())
    (target / file).write_text(json.dumps({**config, key: 48}))
    rows = [{"prompt": "hi"}, {"prompt": " ".join(["word"] * 60)}, {"prompt": "ok"}]
    data = write_jsonl(rows, tmp_path / "in.jsonl")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("transformers").addHandler(handler)
    try:
        args = ("--target", target, "--max-new-tokens", 4, "--batch-size", 3)
        assert regenerate(data, tmp_path / "out.jsonl", *args) == 0
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    said = capsys.readouterr()
    warned = [line for line in said.err.splitlines() if "warning" in line.lower()]
    assert len(warned) == 1, said.err
    assert warned[0].startswith(f"warning: {data}:2: its prompt (")
    assert f"run past the target's maximum length 48 ({what})" in warned[0]
    assert "1 row(s) written with a warning (printed above)" in said.out
    assert not [r.getMessage() for r in records if "maximum" in r.getMessage()]
