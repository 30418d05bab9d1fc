"""What the tests share, so that a test module imports helpers from here and never from another test module.

- ``tiers``, ``scheduling``, ``fixtures``: the pytest plugins ``tests/conftest.py`` registers: the tier markers and
  the unit tier's sandbox, the order pytest-xdist hands files out, and the fixtures that start real servers and
  build the test models.
- ``paths``, ``servers``, ``runs``: where things are; the brokers, stores and pools a test starts; run configs and
  whole ``rlpipe run``s.
- ``messages``, ``trainer``, ``episodes``, ``weights``, ``reward``, ``tuner``, ``deploy``: builders and fakes of one
  concern each (wire messages with defaults, experience for a learner, a scripted engine, ...).
"""
