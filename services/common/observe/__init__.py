"""What a run tells its operator: OpenTelemetry metrics and traces, structured logs, the events file, the metrics
contract and the typed readers of a run's record, experiment trackers and hardware sampling."""
