"""``rlpipe doctor``'s model rows: where model.path's model comes from, and its content hash.

The hash is the one every role checks at start against ``model.sha256`` (services/common/transport/model_source.py);
doctor prints it so an operator can pin it once the folder is trusted. A model.path URL not fetched yet is looked up at
its source (listed, nothing downloaded): doctor does not fetch gigabytes to answer whether a machine is ready.
"""

from __future__ import annotations

from services.common.config import RunConfig
from services.common.refusal import StartRefused
from services.common.startup_checks import CheckResult, human_size, shorten
from services.common.transport.model_source import (
    ModelFetchFailed,
    ModelSource,
    folder_sha256,
    hub_client,
    hub_listing,
    local_model_path,
    model_store,
    s3_listing,
    verify_model,
)


def model_source_row(cfg: RunConfig) -> CheckResult | None:
    """For a model.path URL: fetched already (where), or what its source holds; None for a local folder."""
    if not isinstance(cfg.model.path, str):
        return None
    source = ModelSource.parse(cfg.model.path)
    local = local_model_path(cfg)
    if local is not None:
        return CheckResult("model source", "ok", f"{source.url}: fetched, in {local}")
    fetch = cfg.model.fetch
    try:
        if source.scheme == "s3":
            listed = s3_listing(source, model_store(source, cfg))
            detail = f"{len(listed)} files, {human_size(sum(listed.values()))}"
        elif not fetch.hub_download:
            return CheckResult(
                "model source",
                "fail",
                f"{source.url} is in neither model.fetch.hub_cache_dir nor model.fetch.cache_dir, and "
                "model.fetch.hub_download is off: no role could load it",
            )
        else:
            listing = hub_listing(source, cfg, hub_client(cfg))
            detail = f"{len(listing.files)} files at commit {listing.commit} on {fetch.hub_endpoint}"
    except (StartRefused, ModelFetchFailed) as error:
        return CheckResult("model source", "fail", shorten(error, 500))
    return CheckResult(
        "model source", "ok", f"{source.url}: {detail}; the first start fetches it into {fetch.cache_dir}"
    )


def model_hash_row(cfg: RunConfig) -> CheckResult:
    """The folder's sha256 (``folder_sha256``), against model.sha256 or model.manifest when set."""
    local = local_model_path(cfg)
    if local is None:
        return CheckResult("model hash", "skip", f"{cfg.model.path} is not fetched yet")
    if not local.is_dir():
        return CheckResult("model hash", "skip", f"{local}: no such folder")
    try:
        verify_model(local, cfg.model)
    except StartRefused as error:
        return CheckResult("model hash", "fail", str(error))
    digest = folder_sha256(local)
    if cfg.model.sha256 is not None:
        pinned = "matches model.sha256"
    elif cfg.model.manifest is not None:
        pinned = f"each of its {len(cfg.model.manifest)} files matches model.manifest"
    else:
        pinned = "not pinned: set model.sha256 to it and every role checks it at start"
    return CheckResult("model hash", "ok", f"sha256 {digest} of {local} ({pinned})")


def model_rows(cfg: RunConfig) -> list[CheckResult]:
    source = model_source_row(cfg)
    return [*([source] if source is not None else []), model_hash_row(cfg)]
