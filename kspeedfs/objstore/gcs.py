"""``gs://BUCKET/PREFIX``: Google Cloud Storage, through obstore (``object_store.py``).

Settings, highest first: ``source.gcs_endpoint`` and ``source.gcs_credentials``; then
what Google's own tools read: ``STORAGE_EMULATOR_HOST`` (an emulator such as
fake-gcs-server: requests go unsigned, as google-cloud-storage sends them there),
``GOOGLE_APPLICATION_CREDENTIALS`` (a service-account key or gcloud's authorized-user
file), gcloud's ``~/.config/gcloud/application_default_credentials.json``, the
instance's service account; then, for a dataset being read back, the endpoint its
manifest recorded (and that it was an emulator's). Credentials stay inside obstore.

Identity: the ETag the listing gives, and the generation, which GCS's XML listing does
not: the import learns each object's generation from its first ranged GET
(``x-goog-generation``, ``source.py``) and every later GET asks for that generation
(``?generation=``): an object overwritten after import is a 404 for it, or, in a bucket
that keeps noncurrent versions, still the imported bytes.
"""
from __future__ import annotations

import errno
import json
import os
from typing import TYPE_CHECKING, Any

from ..errors import SourceError
from .object_store import ObjectStoreBucket, open_bucket, require_obstore
from .url import ObjectUrl

if TYPE_CHECKING:
    from ..config import SourceConfig

GOOGLE = "https://storage.googleapis.com"


def emulator_url(host: str) -> str:
    """``STORAGE_EMULATOR_HOST`` as a URL: Google's libraries take ``host:port`` too."""
    return (host if "://" in host else f"http://{host}").rstrip("/") if host else ""


def connect(url: ObjectUrl, cfg: SourceConfig, record: dict[str, str] | None = None) -> ObjectStoreBucket:
    require_obstore(url)
    from obstore.store import GCSStore

    record = record or {}
    emulator = emulator_url(os.environ.get("STORAGE_EMULATOR_HOST", ""))
    endpoint = (cfg.gcs_endpoint.rstrip("/") or emulator or record.get("endpoint") or GOOGLE)
    unsigned = not cfg.gcs_endpoint and (bool(emulator) or record.get("emulator") == "true")
    config: dict[str, Any] = {}
    if unsigned:
        # object_store's switch for an emulator: no token is fetched, nothing is signed
        config["service_account_key"] = json.dumps({
            "gcs_base_url": endpoint, "disable_oauth": True, "client_email": "",
            "private_key": "", "private_key_id": ""})
    else:
        if endpoint != GOOGLE:
            config["base_url"] = endpoint
        creds = cfg.gcs_credentials or os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "")
        if creds:
            if not os.access(creds, os.R_OK):
                raise SourceError(f"{url}: GCS credentials file {creds} cannot be read "
                                  "(GOOGLE_APPLICATION_CREDENTIALS or source.gcs_credentials)",
                                  errno=errno.EACCES)
            config["application_credentials"] = creds
    return open_bucket(url, GCSStore, config, cfg, endpoint, {"emulator": "true"} if unsigned else {})
