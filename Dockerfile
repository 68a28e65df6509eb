# Two images from one file, both installed from the built package (no source tree at run time):
#   docker build --target portal -t dedloc-portal .            # the web portal: no torch, no hivemind
#   docker build --target coordinator -t dedloc-coordinator .  # adds the swarm stack for `dedloc coordinator`
#   docker run -p 8000:8000 -v dedloc:/data dedloc-portal
#   docker run -v dedloc:/data dedloc-coordinator dedloc coordinator --run SLUG
# Set DATABASE_URL=postgresql+psycopg://... to share PostgreSQL between several portal containers.
# compose.yaml runs both images as a stack (PostgreSQL, migration, portal replicas, proxy, coordinators): README.md,
# "Deploying"; tests/test_compose.py keeps it consistent with the targets, EXPOSE and VOLUME here, and these pip
# steps with tests/test_install.py's.

# The dedloc wheel: portal, wire contract and swarm code, with templates, migrations, static files and the
# volunteers' wheels inside.
FROM python:3.11-slim AS build
WORKDIR /src
COPY . .
# pip steps here and in the portal stage: the ones tests/test_install.py runs (tests/test_compose.py compares them).
RUN pip wheel --no-deps -w /wheels . && ls /wheels

FROM python:3.11-slim AS portal
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DEDLOC_DATA_DIR=/data DEDLOC_HOST=0.0.0.0
COPY --from=build /wheels /wheels
COPY constraints.txt /wheels/
# The install step of tests/test_install.py (quiet and no-compile there); tests/test_compose.py keeps them equal.
RUN pip install -c /wheels/constraints.txt /wheels/dedloc-*.whl \
    && useradd --create-home dedloc && mkdir -p /data && chown dedloc /data
USER dedloc
WORKDIR /home/dedloc
VOLUME /data
EXPOSE 8000
CMD ["dedloc", "serve"]

FROM portal AS coordinator
USER root
# torch alone first, pinned: point pip at a CPU wheel index (PIP_INDEX_URL) to keep the image small.
# The coordinator extra adds the worker's dependencies (hivemind) and scipy to the same package. These two are the
# portal's install step with torch and the extra (as `make setup` does); no test runs them (torch is too big).
RUN pip install -c /wheels/constraints.txt torch==2.13.0 \
    && pip install -c /wheels/constraints.txt "$(ls /wheels/dedloc-*.whl)[coordinator]"
USER dedloc
CMD ["dedloc", "coordinator", "--help"]
