"""Object-store sources: a bucket prefix imported, preloaded and read back like a directory.

    kspeedfs import s3://BUCKET/PREFIX
      url.py        S3Url: the bucket and the prefix below which keys are paths
      client.py     connect(): a boto3 client from ``[source]`` and the AWS settings every
                    S3 tool reads; get_range(): one ranged GET pinned to an ETag;
                    the one place a client error becomes a KspeedfsError
      listing.py    list_objects(): the prefix listed in parallel (one task per common
                    prefix, Delimiter='/')
      source.py     S3Source: the importer's ImportSource (keys → the entry tree, ranges
                    read by ranged GETs); the manifest is format 3 (manifest/model.py)
      origin.py     S3Origin: ``origin.Origin`` reading extents by ranged GETs with
                    If-Match, several in flight, each checked against its xxh3

Why boto3: measured against obstore on the same moto server (``python -m
bench.s3_clients``, docs/design.md "Object-store sources"): level on ranged GETs in MB/s
and client CPU per GB, obstore lists 1.25x faster; boto3 alone resolves the whole AWS
settings chain (profiles, ~/.aws files, SSO, instance roles) that obstore would need it
for anyway, and its retry modes do the backoff.
"""
