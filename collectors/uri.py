"""Tracking URIs as rldiag shows and probes them: credentials never printed, servers checked in seconds.

One definition for both sides: the write side's errors and journals, the read side's messages and the
dashboard's sidebar all show `redact_uri(uri)`; an error text that may quote the URI (MLflow's own
errors do, with the password) goes through `redact_text`; `probe_server` is the one reachability check.
"""

from __future__ import annotations

import base64
import re
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


_SECRET_QUERY = re.compile(
    r"(?P<key>[?&;](?:" + "|".join(re.escape(k) for k in sorted(_SECRET_PARAMS, key=len, reverse=True)) + r")=)"
    r"[^&#\s'\"]*",
    re.IGNORECASE,
)
# scheme://userinfo@ anywhere in a text: MLflow's errors quote the URL they called ("API request to
# http://user:pass@host/api/2.0/... failed"), and so may a driver's or a proxy's.
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^\s/?#@'\"]+)@")
_MIN_LITERAL = 4  # shorter secrets are hidden where they sit in a URL, not wherever the letters occur


def uri_secrets(uri: str) -> list[str]:
    """The secrets `uri` carries: its userinfo password (or lone token) and its secret query values,
    as written and percent-decoded."""
    try:
        p = urllib.parse.urlsplit(uri)
    except ValueError:
        return []
    out: set[str] = set()
    if "@" in p.netloc:
        userinfo = p.netloc.rsplit("@", 1)[0]
        secret = userinfo.split(":", 1)[1] if ":" in userinfo else userinfo
        out |= {secret, urllib.parse.unquote(secret)}
    for raw in p.query.split("&"):
        k, _, v = raw.partition("=")
        if urllib.parse.unquote_plus(k).lower() in _SECRET_PARAMS and v:
            out |= {v, urllib.parse.unquote_plus(v)}
    return sorted((s for s in out if s and s != HIDDEN), key=len, reverse=True)


def redact_text(text: str, *uris: str) -> str:
    """`text` (an error message, a log line) with every secret hidden: the password of any URL in it,
    secret query values, and wherever they occur, the secrets of `uris` (the tracking URI in use)."""
    def userinfo(m: re.Match) -> str:
        ui = m["userinfo"]
        return m["scheme"] + (f"{ui.split(':', 1)[0]}:{HIDDEN}" if ":" in ui else HIDDEN) + "@"

    for uri in uris:  # first: a password with an unescaped '@' or '/' defeats the patterns below
        for s in uri_secrets(uri or ""):
            if len(s) >= _MIN_LITERAL:
                text = text.replace(s, HIDDEN)
    text = _URL_USERINFO.sub(userinfo, text)
    return _SECRET_QUERY.sub(lambda m: m["key"] + HIDDEN, text)


def has_secrets(uri: str) -> bool:
    """True when `uri` carries credentials (a userinfo part or a secret query value)."""
    return redact_uri(uri) != uri


def is_redacted(uri: str | None) -> bool:
    """True when `uri` is what `redact_uri` made of one with credentials (its secrets are `***`)."""
    if not uri:
        return False
    try:
        p = urllib.parse.urlsplit(uri)
    except ValueError:
        return False
    userinfo = p.netloc.rsplit("@", 1)[0] if "@" in p.netloc else ""
    if userinfo == HIDDEN or userinfo.endswith(":" + HIDDEN):
        return True
    return any(k.lower() in _SECRET_PARAMS and v == HIDDEN for k, v in
               urllib.parse.parse_qsl(p.query, keep_blank_values=True))


def strip_secrets(uri: str) -> str:
    """`uri` without its userinfo and secret query parameters (what to try when the secrets are gone)."""
    if not has_secrets(uri) and not is_redacted(uri):
        return uri
    p = urllib.parse.urlsplit(uri)
    netloc = p.netloc.rsplit("@", 1)[1] if "@" in p.netloc else p.netloc
    pairs = [(k, v) for k, v in urllib.parse.parse_qsl(p.query, keep_blank_values=True)
             if k.lower() not in _SECRET_PARAMS]
    return urllib.parse.urlunsplit(p._replace(netloc=netloc, query=urllib.parse.urlencode(pairs)))


def same_store(a: str, b: str) -> bool:
    """True when `a` and `b` name the same store (scheme, host, port, path), whatever their credentials."""
    def where(u: str):
        p = urllib.parse.urlsplit(u)
        try:
            port = p.port
        except ValueError:
            port = None
        return p.scheme.lower(), (p.hostname or "").lower(), port, p.path.rstrip("/")

    try:
        return where(a) == where(b)
    except ValueError:
        return False
