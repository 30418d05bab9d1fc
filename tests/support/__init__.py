"""What the tests share, so that a test module imports helpers from here and never from another test module.

- ``tiers``, ``scheduling``, ``fixtures``, ``hardware``: the pytest plugins ``tests/conftest.py`` registers: the
  tier markers and the unit tier's sandbox, the order pytest-xdist hands files out, the fixtures that start real
  servers and build the test models, and NVML faked in process.
- ``paths``, ``servers``, ``runs``: where things are; the brokers, stores and pools a test starts; run configs and
  whole ``rlpipe run``s.
- ``waits``, ``bus``: waiting on a condition, and on a stream's messages, instead of sleeping.
- ``messages``, ``trainer``, ``episodes``, ``weights``, ``rollout``, ``records``, ``models``, ``padless``, ``fates``,
  ``telemetry``, ``tuner``, ``deploy``: builders and fakes of one concern each (wire messages with defaults,
  experience for a learner, a scripted engine, a run's records, a model without a pad token, ...).
"""
