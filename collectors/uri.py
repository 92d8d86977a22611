"""Tracking URIs as rldiag shows and probes them: credentials never printed, servers checked in seconds.

One definition for both sides: the write side's errors and journals, the read side's messages and the
dashboard's sidebar all show `redact_uri(uri)`; `probe_server` is the one reachability check.
"""

from __future__ import annotations

import base64
import urllib.error
import urllib.parse
import urllib.request

# Query parameters that carry a secret (presigned URLs, token-in-URL proxies); their values are hidden.
_SECRET_PARAMS = {"token", "access_token", "auth", "key", "api_key", "apikey", "password", "secret", "signature",
                  "x-amz-signature", "x-amz-credential", "x-amz-security-token", "sig"}
HIDDEN = "***"


def redact_uri(uri: str) -> str:
    """`uri` without its secrets: the userinfo password and secret query values become `***`.

    >>> redact_uri("http://alice:s3cret@mlflow:5000/?token=abc&x=1")
    'http://alice:***@mlflow:5000/?token=***&x=1'
    """
    try:
        p = urllib.parse.urlsplit(uri)
    except ValueError:
        return uri
    netloc = p.netloc
    if "@" not in netloc and not any(k.lower() in _SECRET_PARAMS for k, _ in
                                     urllib.parse.parse_qsl(p.query, keep_blank_values=True)):
        return uri  # nothing to hide (and urlunsplit would drop sqlite:////abs's empty host)
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        # a lone userinfo part is a token (https://TOKEN@host), not a user name
        netloc = f"{user}:{HIDDEN}@{host}" if ":" in userinfo else f"{HIDDEN}@{host}"
    query = p.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_PARAMS for k, _ in pairs):
            query = "&".join(f"{k}={HIDDEN if k.lower() in _SECRET_PARAMS else v}" for k, v in pairs)
    return urllib.parse.urlunsplit(p._replace(netloc=netloc, query=query))


def is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def probe_server(uri: str, timeout_s: float = 10.0) -> str | None:
    """None when the http(s) tracking server at `uri` answers (any HTTP status), else why it does not.

    Fails in seconds where MLflow's client would retry for minutes. Userinfo in the URI
    (`http://user:pass@host`, which MLflow accepts) is sent as basic auth, as MLflow sends it.
    """
    p = urllib.parse.urlsplit(uri)
    headers = {}
    if p.username is not None or p.password is not None:
        creds = f"{urllib.parse.unquote(p.username or '')}:{urllib.parse.unquote(p.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(creds.encode()).decode()
        p = p._replace(netloc=p.netloc.rsplit("@", 1)[1])
    url = urllib.parse.urlunsplit(p._replace(query="", fragment="")).rstrip("/") + "/health"
    try:
        urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None  # it answers: a proxy, an auth wall or no /health route; the real calls decide
    except (OSError, ValueError) as e:
        return str(getattr(e, "reason", e))
    return None
