"""ssh:// URL parsing, the ssh command line and the classification of ssh failures."""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest

from tdbg.connect.bridge_contract import ERROR_PREFIX, EXIT_NO_RUN, EXIT_SEVERAL
from tdbg.connect.ssh import RemoteError, RemoteOptions, bridge_args, classify, ssh_argv
from tdbg.connect.sshurl import SshTarget, SshUrlError, parse_ssh_url

GOOD = [
    ("ssh://host", SshTarget("host")),
    ("ssh://host/", SshTarget("host")),
    ("ssh://me@host", SshTarget("host", "me")),
    ("ssh://me@host:2222", SshTarget("host", "me", 2222)),
    ("ssh://gpu-box.example.com:22", SshTarget("gpu-box.example.com", None, 22)),
    ("ssh://10.0.0.7/tmp/tdbg-0/0-42.sock", SshTarget("10.0.0.7", path="/tmp/tdbg-0/0-42.sock")),
    ("ssh://[::1]:2200/run dir", SshTarget("::1", None, 2200, "/run dir")),
    ("ssh://[fe80::1%eth0]", SshTarget("fe80::1%eth0")),
    ("SSH://my_alias", SshTarget("my_alias")),
    ("ssh://a.b@node1", SshTarget("node1", "a.b")),
]

BAD = [
    ("ssh://me:secret@host", "password"),
    ("ssh://me:@host", "password"),
    ("ssh://host?x=1", "query"),
    ("ssh://host/sock?x", "query"),
    ("ssh://host#frag", "fragment"),
    ("ssh://", "no host"),
    ("ssh:///tmp/x.sock", "no host"),
    ("ssh://me@", "no host"),
    ("ssh://me@:22", "no host"),
    ("ssh://-oProxyCommand=touch%20/tmp/pwned", "start with '-'"),
    ("ssh://-host", "start with '-'"),
    ("ssh://@host", "empty user"),
    ("ssh://-l@host", "invalid user"),
    ("ssh://a@b@host", "invalid user"),
    ("ssh://host\x00evil", "NUL"),
    ("ssh://host\r\nevil", "CR"),
    ("ssh://host\nevil", "LF"),
    ("ssh://host\x1b[31m", "ESC"),
    ("ssh://host\tx", "TAB"),
    ("ssh://host/sock\x7f", "control"),
    ("ssh://host:0", "out of range"),
    ("ssh://host:65536", "out of range"),
    ("ssh://host:-1", "invalid port"),
    ("ssh://host:22x", "invalid port"),
    ("ssh://host:", "invalid port"),
    ("ssh://host:٣", "invalid port"),  # a non-ASCII digit
    ("ssh://ho st", "invalid host"),
    ("ssh://host;rm", "invalid host"),
    ("ssh://$(id)", "invalid host"),
    ("ssh://::1", "brackets"),
    ("ssh://[::1", "unclosed"),
    ("ssh://[::1]x", "after the bracketed host"),
    ("http://host", "must start with ssh://"),
    ("host", "must start with ssh://"),
]


@pytest.mark.parametrize(("text", "expected"), GOOD)
def test_accepts(text: str, expected: SshTarget) -> None:
    assert parse_ssh_url(text) == expected


@pytest.mark.parametrize(("text", "reason"), BAD)
def test_rejects_with_one_line_reason(text: str, reason: str) -> None:
    with pytest.raises(SshUrlError) as err:
        parse_ssh_url(text)
    message = str(err.value)
    assert reason in message
    assert "\n" not in message and "\r" not in message and "\x1b" not in message


def test_url_round_trips() -> None:
    for text in ("ssh://me@host:2222/tmp/a.sock", "ssh://[::1]:22", "ssh://host"):
        assert parse_ssh_url(text).url() == text
    assert parse_ssh_url("ssh://me@h:2/x").node == "me@h:2"


OUR_OPTIONS = [
    "-o",
    "ConnectTimeout=30",
    "-o",
    "ServerAliveInterval=15",
    "-o",
    "ServerAliveCountMax=3",
]


def test_ssh_argv_shape_and_quoting() -> None:
    target = parse_ssh_url("ssh://me@host:2222/tmp/it's here.sock")
    opts = RemoteOptions(("ProxyJump=gw", "Compression=yes"), remote_tdbg="/opt/my env/tdbg")
    argv = ssh_argv(target, opts, bridge_args(target))
    # The user's options first: ssh keeps the first value it sees, so theirs win over ours.
    assert argv[:6] == ["ssh", "-T", "-o", "ProxyJump=gw", "-o", "Compression=yes"]
    assert argv[6:12] == OUR_OPTIONS
    assert argv[12:16] == ["-p", "2222", "-l", "me"]
    dash = argv.index("--")
    assert argv[dash + 1] == "host"
    remote = " ".join(argv[dash + 2 :])  # what ssh hands the remote shell
    assert shlex.split(remote) == [
        "/opt/my env/tdbg",
        "bridge",
        "--socket",
        "/tmp/it's here.sock",
    ]
    # A user-less, port-less URL adds neither flag; --list rides along for discovery.
    plain = ssh_argv(parse_ssh_url("ssh://h"), RemoteOptions(), bridge_args(SshTarget("h"), True))
    assert plain == ["ssh", "-T", *OUR_OPTIONS, "--", "h", "tdbg", "bridge", "--list"]


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client here")
def test_users_ssh_options_win_over_ours() -> None:
    """What ssh itself makes of the argv (``ssh -G`` prints its settings, connects nowhere):
    our ConnectTimeout and keepalives by default, the user's ``-o`` where given."""

    def settings(*options: str) -> dict[str, str]:
        argv = ssh_argv(SshTarget("h"), RemoteOptions(options), ["bridge"])
        out = subprocess.run([argv[0], "-G", *argv[1:]], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)

    ours = settings()
    assert ours["connecttimeout"] == "30"
    assert ours["serveraliveinterval"] == "15" and ours["serveralivecountmax"] == "3"
    theirs = settings("ConnectTimeout=5", "ServerAliveInterval=60")
    assert theirs["connecttimeout"] == "5" and theirs["serveraliveinterval"] == "60"


def test_remote_tdbg_tilde_means_remote_home() -> None:
    argv = ssh_argv(SshTarget("h"), RemoteOptions(remote_tdbg="~/venv/bin/tdbg"), ["bridge"])
    assert argv[-2:] == ['"$HOME"/venv/bin/tdbg', "bridge"]


def test_bad_options_refused() -> None:
    with pytest.raises(RemoteError, match="invalid ssh option"):
        RemoteOptions(options=("ProxyCommand=x\ny",))
    with pytest.raises(RemoteError, match="invalid --remote-tdbg"):
        RemoteOptions(remote_tdbg="")


T = SshTarget("box", "me", 2222)
OPTS = RemoteOptions()


@pytest.mark.parametrize(
    ("rc", "stderr", "expected"),
    [
        (255, "me@box: Permission denied (publickey).", "authentication failed"),
        (255, "ssh: Could not resolve hostname box: Name or service not known", "resolve"),
        (255, "ssh: connect to host box port 2222: Connection refused", "connection refused"),
        (255, "ssh: connect to host box port 2222: Connection timed out", "unreachable"),
        (255, "ssh: connect to host box port 2222: No route to host", "unreachable"),
        (255, "Host key verification failed.", "host key verification failed"),
        (127, "bash: line 1: tdbg: command not found", "--remote-tdbg"),
        (127, "sh: 1: tdbg: not found", "tdbg not found on me@box:2222"),
        (126, "bash: line 1: /x/tdbg: Permission denied", "not executable"),
        (2, "tdbg: error: argument COMMAND: invalid choice: 'bridge'", "too old"),
        (EXIT_NO_RUN, f"{ERROR_PREFIX}no tdbg run in /tmp/tdbg-0", "no tdbg run on me@box"),
        (EXIT_SEVERAL, f"{ERROR_PREFIX}2 runs in /d: /d/a.sock, /d/b.sock", "/SOCKET-PATH"),
        (2, f"{ERROR_PREFIX}no such socket: /x", "me@box:2222: no such socket: /x"),
        (255, "kex_exchange_identification: Connection closed by remote host", "closed"),
        (255, "something odd", "ssh to me@box:2222 failed: something odd"),
    ],
)
def test_classify(rc: int, stderr: str, expected: str) -> None:
    message = classify(T, OPTS, rc, stderr.splitlines())
    assert expected in message
    assert "\n" not in message


def test_remote_halves_never_import_torch() -> None:
    """The bridge runs on the training box from a bare `tdbg`; the local side may be a laptop."""
    import subprocess
    import sys

    code = (
        "import sys, tdbg.cli.main, tdbg.cli.bridge, tdbg.connect.ssh, tdbg.tui.sources.remote; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
