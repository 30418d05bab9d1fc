"""Start-up checks: the cheap subset of ``rlpipe doctor`` a process runs before it loads anything heavy.

A bad model folder, dataset or unwritable store stops a service (or ``rlpipe run``) at
once, with every reason named, instead of minutes later. Each check reads the config and
returns rows of (name, status, detail); ``rlpipe doctor`` (services/cli/doctor/checks.py) runs these
and the machine and broker checks and prints them as a table. They live in ``common``
because every role and both CLIs use them, and ``common`` imports neither.

``rows``: the row, the check and how checks run; ``folders``: model folders and datasets; ``storage``: the
checkpoint store's probe and what a refusal means; ``machine``: ports, the device, the Python tool's box;
``tokens``: the admin and weight-sync tokens; ``roles``: which checks each role runs before it starts.
"""
