"""Security settings parse into the frozen configs, and bad ones fail at start-up naming the setting."""

from __future__ import annotations

import pytest

from specinfer.core import InvalidArgument
from specinfer.request_manager.config import RequestManagerConfig
from specinfer.serving.security import BearerTokenInterceptor, ClientTls, ServerTls, read_token


def test_token_from_value_or_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("  s3cret \n")
    assert read_token("abc", "", "auth-token") == "abc"
    assert read_token("", str(token_file), "auth-token") == "s3cret"
    assert read_token("", "", "auth-token") == ""
    with pytest.raises(ValueError, match="not both"):
        read_token("abc", str(token_file), "auth-token")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token("", str(tmp_path / "empty"), "auth-token")
    with pytest.raises(ValueError, match="cannot read"):
        read_token("", str(tmp_path / "missing"), "auth-token")


def test_tls_files_go_together():
    with pytest.raises(ValueError, match="go together"):
        ServerTls(cert="c.pem")
    with pytest.raises(ValueError, match="mTLS"):
        ServerTls(client_ca="ca.pem")
    with pytest.raises(ValueError, match="go together"):
        ClientTls.from_files(cert="c.pem")
    assert not ClientTls.from_files().enabled and ClientTls.from_files(ca="ca.pem").enabled


@pytest.mark.parametrize(
    "metadata, allowed",
    [
        ((("authorization", "Bearer tok-a"),), True),
        ((("authorization", "Bearer tok-b"),), True),
        ((("authorization", b"Bearer tok-a"),), True),
        ((("authorization", "Bearer tok-"),), False),
        ((("authorization", "bearer tok-a"),), False),
        ((("authorization", "Basic tok-a"),), False),
        ((("authorization", "Bearer tok-a"), ("authorization", "Bearer x")), False),
        ((("x-token", "Bearer tok-a"),), False),
        ((), False),
        (None, False),
    ],
)
def test_bearer_token_check(metadata, allowed):
    assert BearerTokenInterceptor(["tok-a", "tok-b"]).allows(metadata) is allowed


def test_request_manager_refuses_bad_security_settings(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("t\n")
    with pytest.raises(InvalidArgument) as err:
        RequestManagerConfig.from_args(["--auth-token", "a", "--auth-token-file", str(token_file)])
    assert err.value.field == "auth-token"
    with pytest.raises(InvalidArgument) as err:
        RequestManagerConfig.from_args(
            ["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(tmp_path / "missing.key")]
        )
    assert err.value.field == "tls" and "tls-key" in err.value.message
    with pytest.raises(InvalidArgument) as err:
        RequestManagerConfig.from_args(["--tls-client-cert", str(tmp_path / "c.pem")])
    assert err.value.field == "tls"
    cfg = RequestManagerConfig.from_args(["--auth-token-file", str(token_file), "--internal-token", "i"])
    assert cfg.security.tokens == ("t",) and cfg.internal.token == "i" and not cfg.internal.tls.enabled
