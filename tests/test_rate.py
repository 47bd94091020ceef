"""gossamer.comm.rate: one unit inside (bytes per second), the usual spellings outside."""

from __future__ import annotations

import math

import pytest

from gossamer.comm.rate import format_rate, parse_rate


@pytest.mark.parametrize(("value", "expected"), [
    ("1gbit", 125e6),
    ("1Gbit", 125e6),
    ("1 Gbit/s", 125e6),
    ("100mbit", 12.5e6),
    ("250mbit", 31.25e6),
    ("500kbit", 62.5e3),
    ("8bit", 1.0),
    ("10gbit/s", 1.25e9),
    ("125MB/s", 125e6),
    ("1.5GB/s", 1.5e9),
    ("12.5 kB/s", 12.5e3),
    ("1GiB/s", 2.0**30),
    ("2MiB/s", 2.0 * 2**20),
    ("12.5e6", 12.5e6),
    ("  12.5e6 ", 12.5e6),
    (".5e3", 500.0),
    (12.5e6, 12.5e6),
    (125_000_000, 125e6),
])
def test_parse_rate_reads_bits_bytes_and_bare_numbers(value, expected) -> None:
    rate = parse_rate(value)
    assert isinstance(rate, float)
    assert rate == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("value", ["fast", "1gb", "1 gigabit", "125MB", "1gbit/h", "", "1e",
                                   "mbit", "12.5e6 B", "1,000", None, [1e9], True])
def test_parse_rate_refuses_what_is_not_a_rate_and_names_the_argument(value) -> None:
    with pytest.raises(ValueError, match=r"^bandwidth.*(rate|1gbit)"):
        parse_rate(value, arg="bandwidth")


@pytest.mark.parametrize("value", [0, 0.0, -1, "-1", "0gbit", "-5MB/s", math.inf, math.nan,
                                   "inf", "nan"])
def test_parse_rate_refuses_rates_that_are_not_positive_and_finite(value) -> None:
    with pytest.raises(ValueError, match=r"^link 0->1 must be a rate > 0 bytes per second"):
        parse_rate(value, arg="link 0->1")


def test_parse_rate_refuses_bps_as_ambiguous() -> None:
    with pytest.raises(ValueError, match=r"^rate='100Mbps' is not a rate: 'bps' is ambiguous"):
        parse_rate("100Mbps")


@pytest.mark.parametrize(("rate", "text"), [
    (125e6, "1 Gbit/s"),
    (12.5e6, "100 Mbit/s"),
    (1.25e9, "10 Gbit/s"),
    (31.25e6, "250 Mbit/s"),
    (62.5e3, "500 kbit/s"),
    (118e6, "944 Mbit/s"),
    (12.5e12, "100 Tbit/s"),
    (10.0, "80 bit/s"),
])
def test_format_rate_writes_bits_per_second(rate, text) -> None:
    assert format_rate(rate) == text


@pytest.mark.parametrize("rate", [125e6, 12.5e6, 62.5e3, 1.5e9, 10.0, 3.7e7])
def test_format_rate_round_trips_through_parse_rate(rate) -> None:
    assert parse_rate(format_rate(rate)) == pytest.approx(rate, rel=1e-5)


def test_the_simulator_and_the_emulator_read_one_rate_alike() -> None:
    """One `gossamer launch` line can carry both: the same text is the same bytes per second."""
    from gossamer.comm import NetworkModel
    from gossamer.launch import LinkSpec, parse_link_spec

    for text in ("1gbit", "250mbit", "125MB/s", "12.5e6"):
        simulated = NetworkModel(bandwidth=text, link_bandwidth={(0, 1): text})
        emulated = parse_link_spec(f"bandwidth={text}")
        assert simulated.bandwidth == simulated.link_bandwidth[(0, 1)] == \
            LinkSpec(bandwidth=text).bandwidth == emulated.bandwidth == parse_rate(text)
    assert NetworkModel(bandwidth="1gbit").transfer_time(0, 1, 125_000_000) == 1.0


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"bandwidth": "fast"}, "bandwidth"),
    ({"bandwidth": "-1gbit"}, "bandwidth"),
    ({"link_bandwidth": {(0, 1): "1 furlong"}}, r"link_bandwidth\[\(0, 1\)\]"),
])
def test_network_model_names_the_bad_rate(kwargs, name) -> None:
    from gossamer.comm import NetworkModel

    with pytest.raises(ValueError, match=f"^{name}"):
        NetworkModel(**kwargs)
