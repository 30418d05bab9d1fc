"""The circuit breaker's state machine, on a clock the test moves: no sleeping, no broker."""

import pytest

from services.common.transport.breaker import BreakerState, CircuitBreaker

pytestmark = pytest.mark.unit


def test_circuit_breaker_backs_off_opens_probes_and_closes():
    now = [100.0]
    breaker = CircuitBreaker(threshold=3, cooldown_s=10.0, backoff_s=0.5, clock=lambda: now[0])
    assert breaker.state is BreakerState.CLOSED and breaker.retry_in() == 0.0 and breaker.down_for() == 0.0
    breaker.failed()
    assert breaker.state is BreakerState.CLOSED and breaker.retry_in() == 0.5
    now[0] += 0.5
    assert breaker.retry_in() == 0.0
    breaker.failed()
    assert breaker.state is BreakerState.CLOSED and breaker.retry_in() == 1.0  # doubled
    now[0] += 1.0
    breaker.failed()  # the third in a row: open for a full cool-down
    assert breaker.state is BreakerState.OPEN and breaker.retry_in() == 10.0
    now[0] += 9.0
    assert breaker.state is BreakerState.OPEN and breaker.retry_in() == 1.0
    now[0] += 1.0
    assert breaker.state is BreakerState.HALF_OPEN and breaker.retry_in() == 0.0
    breaker.failed()  # the probe failed: open again
    assert breaker.state is BreakerState.OPEN and breaker.retry_in() == 10.0
    assert breaker.failures == 4 and breaker.down_for() == 11.5
    now[0] += 10.0
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.succeeded()
    assert breaker.state is BreakerState.CLOSED and breaker.failures == 0 and breaker.retry_in() == 0.0
    assert breaker.down_for() == 0.0
    breaker.failed()  # a new streak starts from the short backoff again
    assert breaker.state is BreakerState.CLOSED and breaker.retry_in() == 0.5
    with pytest.raises(ValueError):
        CircuitBreaker(threshold=0)


def test_circuit_breaker_trips_open_at_the_first_failure_that_retrying_would_repeat():
    now = [100.0]
    breaker = CircuitBreaker(threshold=3, cooldown_s=10.0, backoff_s=0.5, clock=lambda: now[0])
    breaker.trip()
    assert breaker.state is BreakerState.OPEN and breaker.failures == 1 and breaker.retry_in() == 10.0
    now[0] += 10.0
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.succeeded()
    assert breaker.state is BreakerState.CLOSED and breaker.failures == 0
