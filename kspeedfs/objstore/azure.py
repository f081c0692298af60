"""``az://CONTAINER/PREFIX``: Azure Blob Storage, through obstore (``object_store.py``).

The URL names the container, as adlfs/fsspec and obstore write it; the storage account
comes from the settings, highest first: the ``source.azure_*`` keys, then what the
``az`` CLI and the Azure SDKs read: ``AZURE_STORAGE_CONNECTION_STRING`` (its
``AccountName``, ``AccountKey``, ``SharedAccessSignature``, ``BlobEndpoint``,
``EndpointSuffix``, ``DefaultEndpointsProtocol``, or ``UseDevelopmentStorage=true``),
``AZURE_STORAGE_ACCOUNT`` with ``AZURE_STORAGE_KEY`` or ``AZURE_STORAGE_SAS_TOKEN``;
without a key or SAS, obstore's own chain (``AZURE_CLIENT_ID``/``AZURE_CLIENT_SECRET``/
``AZURE_TENANT_ID``, a federated token, the Azure CLI, a managed identity). For a
dataset being read back, the account and endpoint its manifest recorded apply where
nothing names them. Azurite, the emulator, is a connection string with its well-known
development account and a ``BlobEndpoint`` of ``http://HOST:PORT/devstoreaccount1``.

Identity: the ETag (every ranged GET sends ``If-Match``; Azure answers 412 once the blob
was overwritten) and, where the account keeps blob versions, the version id the import's
first GET was served (``x-ms-version-id``), which later GETs ask for.
"""
from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING, Any

from ..errors import SourceError
from .object_store import ObjectStoreBucket, open_bucket, require_obstore
from .url import ObjectUrl

if TYPE_CHECKING:
    from ..config import SourceConfig

# Azurite's development account: published by Microsoft, the same in every installation
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
           "KBHBeksoGMGw==")


def parse_connection_string(text: str) -> dict[str, str]:
    """``Key=Value;...`` (values may hold ``=``); ``UseDevelopmentStorage=true`` becomes
    Azurite's account on its default port. Never echoes ``text``: it holds the key."""
    fields: dict[str, str] = {}
    for part in text.split(";"):
        name, sep, value = part.strip().partition("=")
        if not part.strip():
            continue
        if not sep or not name:
            raise SourceError("AZURE_STORAGE_CONNECTION_STRING (or source.azure_connection_string)"
                              " is not Key=Value;... pairs", errno=errno.EINVAL)
        fields[name] = value
    if fields.get("UseDevelopmentStorage", "").lower() == "true":
        fields.setdefault("AccountName", DEV_ACCOUNT)
        fields.setdefault("AccountKey", DEV_KEY)
        fields.setdefault("BlobEndpoint", f"http://127.0.0.1:10000/{DEV_ACCOUNT}")
    return fields


def connect(url: ObjectUrl, cfg: SourceConfig, record: dict[str, str] | None = None) -> ObjectStoreBucket:
    require_obstore(url)
    from obstore.store import AzureStore

    record = record or {}
    env = os.environ.get
    conn = parse_connection_string(cfg.azure_connection_string
                                   or env("AZURE_STORAGE_CONNECTION_STRING", ""))
    account = (cfg.azure_account or env("AZURE_STORAGE_ACCOUNT", "") or conn.get("AccountName", "")
               or record.get("account", ""))
    if not account:
        raise SourceError(f"{url}: no Azure storage account: set AZURE_STORAGE_ACCOUNT or "
                          "AZURE_STORAGE_CONNECTION_STRING, or source.azure_account",
                          errno=errno.EACCES)
    key = cfg.azure_key or env("AZURE_STORAGE_KEY", "") or conn.get("AccountKey", "")
    sas = cfg.azure_sas or env("AZURE_STORAGE_SAS_TOKEN", "") or conn.get("SharedAccessSignature", "")
    suffix = conn.get("EndpointSuffix", "core.windows.net")
    scheme = conn.get("DefaultEndpointsProtocol", "https")
    endpoint = (cfg.azure_endpoint or conn.get("BlobEndpoint", "") or record.get("endpoint", "")
                or f"{scheme}://{account}.blob.{suffix}").rstrip("/")
    config: dict[str, Any] = {"account_name": account, "endpoint": endpoint}
    if key:
        config["account_key"] = key
    elif sas:
        config["sas_key"] = sas.lstrip("?")
    return open_bucket(url, AzureStore, config, cfg, endpoint, {"account": account})
