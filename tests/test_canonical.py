"""Key parsing, strict body parsing and fingerprints: the bad inputs of
research/anchors-reliability.md section 6 (B1-B15, B17-B26) at the API level.

Every refusal must be one of `outbox.errors`' client errors (400, or 413 for a body
over the limit), never another exception: anything else would become a 500 after an
adapter has already claimed the key.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from outbox import canonical_json, fingerprint, parse_idempotency_key, parse_json_body
from outbox._canonical import MAX_DEPTH, MAX_KEY_LENGTH, json_fingerprint
from outbox.errors import (
    InvalidIdempotencyKey,
    InvalidInput,
    InvalidRequestBody,
    RequestBodyTooLarge,
)

PURE = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def refused_key(value: Any, **kwargs: Any) -> InvalidIdempotencyKey:
    with pytest.raises(InvalidIdempotencyKey) as info:
        parse_idempotency_key(value, **kwargs)
    assert info.value.status == 400
    assert info.value.code == "invalid_idempotency_key"
    return info.value


def refused_body(raw: bytes, **kwargs: Any) -> InvalidRequestBody:
    with pytest.raises(InvalidRequestBody) as info:
        parse_json_body(raw, **kwargs)
    expected = 413 if isinstance(info.value, RequestBodyTooLarge) else 400
    assert info.value.status == expected
    return info.value


# --- Idempotency-Key header ------------------------------------------------------------

def test_b1_missing_key_is_400_when_required() -> None:
    refused_key(None)
    refused_key([])
    assert parse_idempotency_key(None, required=False) is None
    assert parse_idempotency_key([], required=False) is None


@pytest.mark.parametrize("value", ["", " ", "   ", "\t", " \t ", '""', '" "', '"   "',
                                   [""], ["  "]])
def test_b2_empty_or_blank_key_is_400(value: Any) -> None:
    refused_key(value)


def test_b3_length_boundary_255_accepted_256_refused() -> None:
    assert parse_idempotency_key("k" * MAX_KEY_LENGTH) == "k" * 255
    assert MAX_KEY_LENGTH == 255
    refused_key("k" * 256)
    # The limit is on the key, not on the header: quotes don't count.
    assert parse_idempotency_key('"' + "k" * 255 + '"') == "k" * 255
    refused_key('"' + "k" * 256 + '"')


@pytest.mark.parametrize("size", [16 * 1024, 100 * 1024])
def test_b4_huge_header_is_400(size: int) -> None:
    refused_key("a" * size)
    refused_key('"' + "a" * size + '"')


def test_b5_minimum_length_is_a_policy() -> None:
    # Default: any non-empty key (the IETF draft sets no minimum).
    assert parse_idempotency_key("1") == "1"
    assert parse_idempotency_key("aaaa") == "aaaa"
    # With Brandur's minimum of 20, short keys are refused.
    refused_key("1", min_length=20)
    refused_key("aaaa", min_length=20)
    assert parse_idempotency_key("a" * 20, min_length=20) == "a" * 20


@pytest.mark.parametrize("value", ["caf\u00e9", "\U0001f600", "abc\u200f", "a\u200db",
                                   "\u00a0abc", "abc\u2028", "\ufeffabc", "\u0430bc",
                                   '"caf\u00e9"', '"a\u200db"'])
def test_b6_non_ascii_key_is_400(value: str) -> None:
    refused_key(value)


@pytest.mark.parametrize("value", ["\x00", "a\x00b", "%00\x00", "a\rb", "a\nb", "a\r\nb",
                                   "a\r\nX-Injected: 1", "a\tb", "a\x7fb", "\x1b[31m",
                                   "a\x0bb", "a\x0cb", "abc\n", '"a\x00b"', '"a\tb"',
                                   '"a\nb"'])
def test_b7_control_characters_are_400(value: str) -> None:
    refused_key(value)


def test_b7_optional_whitespace_around_the_value_is_trimmed_like_http_does() -> None:
    # RFC 9110 OWS (SP / HTAB) around a field value is not part of it.
    assert parse_idempotency_key(" abc\t") == "abc"
    assert parse_idempotency_key('\t"abc" ') == "abc"


def test_b8_quoted_sf_string_equals_bare_token() -> None:
    assert parse_idempotency_key('"abc"') == parse_idempotency_key("abc") == "abc"
    assert parse_idempotency_key(['"abc"']) == "abc"
    # sf-string escapes: \" and \\ only.
    assert parse_idempotency_key(r'"a\"b"') == 'a"b'
    assert parse_idempotency_key(r'"a\\b"') == "a\\b"
    # Inside quotes a space is a legal character.
    assert parse_idempotency_key('"a b"') == "a b"


@pytest.mark.parametrize("value", [r'"a\b"', r'"abc\"', r'"a"b"', r'"a\\"b"', r'"\\"\"',
                                   r'"\"', '"a", "b"'])
def test_b8_malformed_sf_string_is_400(value: str) -> None:
    refused_key(value)


_SF_STRING = re.compile(r'"((?:[ !#-\[\]-~]|\\["\\])*)"')


@PURE
@given(st.text(alphabet='ab"\\ ,', max_size=12))
def test_b8_quoted_form_agrees_with_rfc8941(inner: str) -> None:
    """Property: a quoted value parses iff it is an RFC 8941 sf-string, to its content."""
    header = f'"{inner}"'
    match = _SF_STRING.fullmatch(header)
    expected = None
    if match is not None:
        expected = re.sub(r'\\(["\\])', r"\1", match.group(1))
        if not expected.strip(" "):
            expected = None  # empty or blank: B2
    try:
        got = parse_idempotency_key(header)
    except InvalidIdempotencyKey:
        got = None
    assert got == expected


@pytest.mark.parametrize("value", [["a", "b"], ["abc", "abc"], "a, b", "a,b", "a,", ",a"])
def test_b9_two_keys_are_400(value: Any) -> None:
    refused_key(value)


def test_b9_comma_inside_a_quoted_key_is_one_key() -> None:
    assert parse_idempotency_key('"a,b"') == "a,b"


def test_b10_keys_are_case_sensitive() -> None:
    assert parse_idempotency_key("ABC") == "ABC"
    assert parse_idempotency_key("abc") == "abc"
    assert parse_idempotency_key("ABC") != parse_idempotency_key("abc")


@pytest.mark.parametrize("value", ["';DROP_TABLE_idem;--", "%", "_", "\\", "a%b_c",
                                   "1'OR'1'='1", "$1", ":key", "{{x}}", "<script>"])
def test_b11_sql_like_keys_are_opaque_printable_ascii(value: str) -> None:
    assert parse_idempotency_key(value) == value


def test_b11_quoted_sql_key_with_spaces() -> None:
    assert parse_idempotency_key("\"'; DROP TABLE idem;--\"") == "'; DROP TABLE idem;--"


_PRINTABLE = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E),
                     min_size=1, max_size=MAX_KEY_LENGTH)


@PURE
@given(_PRINTABLE)
def test_every_printable_ascii_key_round_trips_bare_and_quoted(key: str) -> None:
    quoted = '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    assert parse_idempotency_key(quoted) == key
    bare_is_quoted = len(key) >= 2 and key[0] == key[-1] == '"'
    if "," not in key and not bare_is_quoted:
        assert parse_idempotency_key(key) == key


@PURE
@given(st.one_of(st.text(max_size=300), st.lists(st.text(max_size=40), max_size=3),
                 st.none()))
def test_key_parser_never_raises_anything_else(value: Any) -> None:
    try:
        key = parse_idempotency_key(value)
    except InvalidIdempotencyKey as exc:
        assert exc.status == 400
        return
    assert key is not None
    assert 1 <= len(key) <= MAX_KEY_LENGTH
    assert all(0x20 <= ord(c) <= 0x7E for c in key)
    assert key.strip(" ")
    key.encode("ascii")  # fits a PostgreSQL text column and an HTTP header


# --- Request bodies --------------------------------------------------------------------

@pytest.mark.parametrize("raw", [b"not json", b"{", b"}", b"{'a': 1}", b"[1,]",
                                 b'{"a":1} trailing', b'{"a":1}{"b":2}', b'"unterminated',
                                 b"01", b"tru", b"{a: 1}", b'{"a" 1}', b"<xml/>",
                                 b"\xef\xbb\xbf{}", b'"\x01"', b'"a\x00b"', b"--", b"+1",
                                 b".5", b"0x10", b'"\\x41"'])
def test_b17_non_json_body_is_400(raw: bytes) -> None:
    refused_body(raw)


@pytest.mark.parametrize("raw", [b"\xff", b"\xfe\xff{}", b'{"a":"\xc3\x28"}',
                                 b'{"a":"\xed\xa0\x80"}', b'"\xc0\xaf"', b'"\xf8\x88\x80"',
                                 b'"caf\xe9"', '{"a":1}'.encode("utf-16")])
def test_b18_invalid_utf8_is_400(raw: bytes) -> None:
    refused_body(raw)


@pytest.mark.parametrize("raw", [b'{"a":1,"a":2}', b'{"a":1,"a":1}',
                                 b'{"x":{"a":1,"b":0,"a":2}}', b'[{"k":null,"k":null}]',
                                 b'{"a":1,"\\u0061":2}'])
def test_b19_duplicate_members_are_400(raw: bytes) -> None:
    refused_body(raw)


@pytest.mark.parametrize("raw", [b"NaN", b"Infinity", b"-Infinity", b'{"a":NaN}',
                                 b"[1,Infinity]", b'{"a":{"b":[-Infinity]}}',
                                 b"1e400", b"-1e400", b'{"a":1e999}', b"[" + b"9" * 400 + b".0]"])
def test_b20_non_finite_numbers_are_400(raw: bytes) -> None:
    refused_body(raw)


def test_b21_huge_integers_are_400_but_representable_ones_pass() -> None:
    refused_body(b"1" * 5000)
    refused_body(b'{"amount":-' + b"9" * 5000 + b"}")
    assert parse_json_body(b"9" * 4000) == int("9" * 4000)
    assert parse_json_body(b"1e-400") == 0.0  # underflow is a finite number


@pytest.mark.parametrize("raw", [b'"\\u0000"', b'{"a":"x\\u0000y"}', b'{"\\u0000":1}',
                                 b'["ok",["\\u0000"]]'])
def test_b22_nul_in_strings_is_400(raw: bytes) -> None:
    refused_body(raw)


@pytest.mark.parametrize("raw", [b'"\\ud800"', b'"\\udc00"', b'{"\\udfff":1}',
                                 b'["a\\ud83d"]', b'"\\ude00\\ud83d"'])
def test_b23_lone_surrogates_are_400(raw: bytes) -> None:
    refused_body(raw)


def test_b23_a_surrogate_pair_is_one_character() -> None:
    assert parse_json_body(b'"\\ud83d\\ude00"') == "\U0001f600"


@pytest.mark.parametrize("depth", [MAX_DEPTH + 2, 1_000, 10_000, 100_000])
@pytest.mark.parametrize("open_close", [(b"[", b"]"), (b'{"a":', b"}")])
def test_b24_deep_nesting_is_400(depth: int, open_close: tuple[bytes, bytes]) -> None:
    opening, closing = open_close
    refused_body(opening * depth + b"1" + closing * depth)


def test_b24_reasonable_nesting_passes() -> None:
    depth = MAX_DEPTH - 2
    value = parse_json_body(b"[" * depth + b"1" + b"]" * depth)
    for _ in range(depth):
        assert isinstance(value, list)
        value = value[0]
    assert value == 1


def test_b25_body_over_the_limit_is_413_before_parsing() -> None:
    limit = 1_048_576
    body = b'"' + b"x" * (limit - 2) + b'"'
    assert len(body) == limit
    assert parse_json_body(body) == "x" * (limit - 2)
    error = refused_body(body + b" ")
    assert isinstance(error, RequestBodyTooLarge)
    assert error.status == 413
    # Refused on size alone: garbage over the limit is still a 413, not a 400.
    assert isinstance(refused_body(b"\xff" * (10 * limit)), RequestBodyTooLarge)
    assert isinstance(refused_body(b"[1]", max_bytes=2), RequestBodyTooLarge)


@pytest.mark.parametrize("raw", [b"", b" ", b"\n\r\t ", b"\x0c"])
def test_b26_empty_body_is_400_unless_allowed(raw: bytes) -> None:
    refused_body(raw)
    assert parse_json_body(raw, allow_empty=True) is None


def test_error_tree_maps_to_http_statuses() -> None:
    assert issubclass(InvalidIdempotencyKey, InvalidInput)
    assert issubclass(InvalidRequestBody, InvalidInput)
    assert issubclass(RequestBodyTooLarge, InvalidRequestBody)
    assert InvalidIdempotencyKey("x").status == 400
    assert InvalidRequestBody("x").status == 400
    assert RequestBodyTooLarge("x").status == 413


_JSONISH = st.text(alphabet='{}[]":,0123456789.eE+- \ttrufalsnNIiy\\u0dD8A', max_size=40)


@PURE
@given(st.one_of(st.binary(max_size=200), _JSONISH.map(lambda s: s.encode())))
def test_body_parser_never_raises_anything_else(raw: bytes) -> None:
    """Whatever comes in: a value every later stage accepts, or InvalidRequestBody."""
    try:
        value = parse_json_body(raw)
    except InvalidRequestBody as exc:
        assert exc.status in (400, 413)
        return
    # Everything downstream of a parsed body must work without an exception.
    canonical_json(value).encode("utf-8")
    json.dumps(value, allow_nan=False).encode("utf-8")
    fingerprint("POST", "/orders", value)


# --- Fingerprints ----------------------------------------------------------------------

_TEXT = st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
                max_size=8)
_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                  st.floats(allow_nan=False, allow_infinity=False), _TEXT)
_JSON = st.recursive(
    _LEAF,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(_TEXT, children, max_size=4)),
    max_leaves=20,
)


def _reserialise(value: Any, data: st.DataObject) -> Any:
    """The same document as another client might write it: any member order, and
    integers written as floats where that is exact."""
    if isinstance(value, dict):
        items = list(value.items())
        order = data.draw(st.permutations(items))
        return {k: _reserialise(v, data) for k, v in order}
    if isinstance(value, list):
        return [_reserialise(v, data) for v in value]
    if (isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**53
            and data.draw(st.booleans())):
        return float(value)
    return value


@PURE
@given(_JSON, st.data())
def test_equivalent_reserialisations_never_change_the_fingerprint(
        value: Any, data: st.DataObject) -> None:
    original = json.dumps(value).encode()
    other = _reserialise(value, data)
    indent = data.draw(st.sampled_from([None, 0, 2, "\t"]))
    separators = data.draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]))
    ensure_ascii = data.draw(st.booleans())
    text = json.dumps(other, indent=indent, separators=separators, ensure_ascii=ensure_ascii)
    if data.draw(st.booleans()):
        text = "\n  " + text + " \r\n"
    a = parse_json_body(original)
    b = parse_json_body(text.encode("utf-8"))
    assert fingerprint("POST", "/orders", a) == fingerprint("POST", "/orders", b)
    assert json_fingerprint(a) == json_fingerprint(b)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {k: (_replace(v, rest, new) if k == head else v) for k, v in value.items()}
    return [(_replace(v, rest, new) if i == head else v) for i, v in enumerate(value)]


def _mutate(value: Any, data: st.DataObject) -> Any:
    path = data.draw(st.sampled_from(_paths(value)))
    target = value
    for step in path:
        target = target[step]
    how = data.draw(st.sampled_from(["replace", "grow", "shrink"]))
    new: Any
    if how == "grow" and isinstance(target, dict):
        new = dict(target)
        new[data.draw(_TEXT)] = data.draw(_LEAF)
    elif how == "grow" and isinstance(target, list):
        new = [*target, data.draw(_LEAF)]
    elif how == "shrink" and isinstance(target, dict) and target:
        drop = data.draw(st.sampled_from(sorted(target)))
        new = {k: v for k, v in target.items() if k != drop}
    elif how == "shrink" and isinstance(target, list) and target:
        new = target[:-1]
    else:
        new = data.draw(_JSON)
    return _replace(value, path, new)


@PURE
@given(_JSON, st.data())
def test_any_mutated_value_changes_the_fingerprint(value: Any, data: st.DataObject) -> None:
    mutated = _mutate(value, data)
    # A "mutation" that is only a re-serialisation (1 -> 1.0, 0.0 -> -0.0) is no change.
    assume(canonical_json(mutated) != canonical_json(value))
    a = parse_json_body(json.dumps(value).encode())
    b = parse_json_body(json.dumps(mutated).encode())
    assert fingerprint("POST", "/orders", a) != fingerprint("POST", "/orders", b)


def test_b15_reordered_keys_whitespace_and_1_vs_1_0_share_a_fingerprint() -> None:
    bodies = [
        b'{"amount": 1, "currency": "EUR", "meta": {"x": [1, 2.0], "y": null}}',
        b'{"currency":"EUR","meta":{"y":null,"x":[1.0,2]},"amount":1.0}',
        b'\n{ "meta" : { "x" : [ 1e0 , 2 ] , "y" : null } ,\t"amount" : 10E-1,'
        b' "currency" : "\\u0045UR" }\r\n',
    ]
    prints = {fingerprint("POST", "/payments", parse_json_body(b)) for b in bodies}
    assert len(prints) == 1


def test_b14_different_values_give_different_fingerprints() -> None:
    base = parse_json_body(b'{"amount": 1, "currency": "EUR"}')
    for other in [b'{"amount": 2, "currency": "EUR"}', b'{"amount": "1", "currency": "EUR"}',
                  b'{"amount": true, "currency": "EUR"}', b'{"amount": 1, "currency": "eur"}',
                  b'{"amount": 1}', b'{"amount": 1, "currency": "EUR", "x": null}',
                  b'{"amount": 1.5, "currency": "EUR"}', b'[{"amount": 1, "currency": "EUR"}]']:
        assert fingerprint("POST", "/p", base) != fingerprint("POST", "/p", parse_json_body(other))


def test_b13_method_and_path_are_part_of_the_fingerprint() -> None:
    body = {"amount": 1}
    post = fingerprint("POST", "/payments", body)
    assert fingerprint("post", "/payments", body) == post  # methods are case-insensitive
    assert fingerprint("PUT", "/payments", body) != post
    assert fingerprint("PATCH", "/payments", body) != post
    assert fingerprint("POST", "/payments/", body) != post
    assert fingerprint("POST", "/Payments", body) != post
    assert fingerprint("POST", "/refunds", body) != post
    # The body alone never collides with the request envelope.
    assert fingerprint("POST", "/payments", None) != fingerprint("POST", "/payments", {})


def test_opted_in_headers_are_part_of_the_fingerprint() -> None:
    body = {"a": 1}
    base = fingerprint("POST", "/p", body, {"X-Tenant": "t1"})
    assert fingerprint("POST", "/p", body, {"x-tenant": "t1"}) == base  # names fold case
    assert fingerprint("POST", "/p", body, {"X-Tenant": "t2"}) != base
    assert fingerprint("POST", "/p", body) != base


def test_canonical_json_is_sorted_compact_and_keeps_unicode() -> None:
    assert canonical_json({"b": [1.0, 2.5], "a": "\u00e9"}) == '{"a":"\u00e9","b":[1,2.5]}'
    assert canonical_json(-0.0) == "0"
    with pytest.raises(InvalidRequestBody):
        canonical_json(float("nan"))
    with pytest.raises(InvalidRequestBody):
        canonical_json({"a": [float("inf")]})
