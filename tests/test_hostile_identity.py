"""Mutual-TLS caller identities name their fields (audit L7).

The identity was the certificate's common names (else its SANs) joined with ``,``: a certificate
with CN ``a,b`` and one with the two CNs ``a`` and ``b`` were one tenant, as were a CN ``x`` and a
SAN ``x``. The identity now names the field and percent-quotes each value. The auth context here
is the dict gRPC hands the servicer (``context.auth_context()``), on a stand-in call context.
"""

from __future__ import annotations

from ferrum_service.core.callers import caller_identity


class _Call:
    """The two things ``caller_identity`` reads from a gRPC servicer context."""

    def __init__(self, auth: dict) -> None:
        self._auth = auth

    def invocation_metadata(self):
        return ()

    def auth_context(self):
        return self._auth


def _who(**auth) -> str:
    return caller_identity(_Call(auth), tokens_checked=False)


def test_distinct_certificates_are_distinct_callers():
    one_name_with_comma = _who(x509_common_name=[b"a,b"])
    two_names = _who(x509_common_name=[b"a", b"b"])
    assert one_name_with_comma != two_names
    assert _who(x509_common_name=[b"x"]) != _who(x509_subject_alternative_name=[b"x"])
    assert _who(x509_common_name=[b"scheduler"]) == "x509:CN=scheduler"
    assert _who(x509_subject_alternative_name=[b"svc.ns", b"10.0.0.1"]) == "x509:SAN=svc.ns,10.0.0.1"
    assert _who() == ""
