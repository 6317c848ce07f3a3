# crowdtrain for volunteers with an NVIDIA GPU:
#   docker build -t crowdtrain .
#   docker run --gpus all -p 31330:31330 -v crowdtrain-state:/state crowdtrain \
#       --initial-peers /ip4/203.0.113.5/tcp/31330/p2p/Qm... --announce /ip4/<your public IP>/tcp/31330
# The state volume keeps the identity (same peer ID after restarts) and checkpoints.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/crowdtrain
COPY setup.cfg pyproject.toml README.md ./
COPY crowdtrain ./crowdtrain
# torch comes from the base image (CUDA build); the range in setup.cfg accepts it.
RUN pip install .

VOLUME /state
EXPOSE 31330/tcp
STOPSIGNAL SIGTERM
ENTRYPOINT ["crowdtrain", "run", "--state-dir", "/state", "--listen", "/ip4/0.0.0.0/tcp/31330"]
