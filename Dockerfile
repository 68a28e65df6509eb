# The portal and the coordinator in one image (run one container per role):
#   docker run -p 8000:8000 -v dedloc:/data IMAGE                       # the web portal
#   docker run -v dedloc:/data IMAGE dedloc coordinator --run SLUG      # a run's coordinator
# Set DATABASE_URL=postgresql+psycopg://... to share PostgreSQL between several portal containers.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DEDLOC_DATA_DIR=/data DEDLOC_HOST=0.0.0.0
WORKDIR /srv/dedloc

COPY constraints.txt pyproject.toml alembic.ini ./
COPY worker ./worker
# torch alone first, pinned: point pip at a CPU wheel index (PIP_INDEX_URL) to keep the image small.
RUN pip install -c constraints.txt torch==2.13.0
COPY app ./app
COPY templates ./templates
COPY migrations ./migrations
RUN pip install -c constraints.txt ./worker . && useradd --create-home dedloc && mkdir -p /data \
    && chown dedloc /data
USER dedloc
VOLUME /data
EXPOSE 8000
CMD ["dedloc", "serve"]
