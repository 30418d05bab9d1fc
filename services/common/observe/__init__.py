"""What a run tells its operator: OpenTelemetry metrics and traces, structured logs, the events file, experiment
trackers and hardware sampling."""
