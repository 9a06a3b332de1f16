# The rdmastream image: one image for every service of docker-compose.yml and deploy/k8s/
# (sender, receiver, processor). Runtime libraries only, no compiler: the binaries and the
# GStreamer plugin come from the host's build, so build them first:
#
#   cargo build --release            # target/release/{sender,receiver,libgstrdma.so}
#   docker build -t localhost/rdmastream:latest .     # or: docker compose build
#
# The build context is the repository root, but .dockerignore lets in only those three files,
# deploy/image/ and assets/ (target/ holds gigabytes of build files). The binaries are built
# against Debian 12's libraries, which is what this image has.
FROM debian:bookworm

# - rdma-core providers: libibverbs1 loads the NIC's provider (mlx5, rxe, ...) at run time from
#   ibverbs-providers; the transport falls back to tcp where no device is passed in.
# - libnl, libunwind, libdw: the rest of what `ldd target/release/receiver` lists beyond glibc
#   and GStreamer's core.
# - GStreamer: core and app/base libraries for the binaries' gstreamer sources and sinks and the
#   plugin; base (videoconvert, rawvideoparse, pngdec), good (mp4mux), ugly (x264enc) for the
#   processor; gst-discoverer-1.0 for the compose demo's checks. No H.264 decoder: libav would
#   add about 300 MB of codec libraries to every service's image for a check that the
#   demuxer and gst-discoverer-1.0 already make (the MP4s play in any player on the host).
# - python3 for the processor script (standard library only).
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libibverbs1 ibverbs-providers rdma-core libnl-3-200 libnl-route-3-200 libunwind8 libdw1 \
        gstreamer1.0-tools gstreamer1.0-plugins-base gstreamer1.0-plugins-good \
        gstreamer1.0-plugins-ugly gstreamer1.0-plugins-base-apps \
        python3 \
    && rm -rf /var/lib/apt/lists/*

# The plugin in a directory of its own: `gst-inspect-1.0 rdmasink` works in the container.
ENV GST_PLUGIN_PATH=/usr/local/lib/gstreamer-1.0
COPY target/release/sender target/release/receiver /usr/local/bin/
COPY target/release/libgstrdma.so /usr/local/lib/gstreamer-1.0/
COPY deploy/image/rdmastream-run deploy/image/rdmastream-process /usr/local/bin/
# For the `images` source (edge-2 in the compose demo).
COPY assets/ /usr/share/rdmastream/assets/

# The status page, /metrics, /healthz and /readyz when RDMASTREAM_METRICS (or `metrics` in a
# config) is set; 7471 is the receiver's default listen port.
EXPOSE 7471 8080
WORKDIR /data
# Translates the runtime's SIGTERM into the SIGINT the binaries stop cleanly on.
ENTRYPOINT ["rdmastream-run"]
CMD ["receiver", "--help"]
