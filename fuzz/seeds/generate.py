#!/usr/bin/env python3
"""Write the seed inputs of both fuzz targets into seeds/<target>/ (a valid session of
every command, one command per file, and a VERSION with every capability)."""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def msg(mid, cmd, payload, flags=0):
    return struct.pack('<HHIII', mid, cmd, 16 + len(payload), flags, 0) + payload


def acc(region, off, count):
    return struct.pack('<QII', off, region, count)


cmds = [
    msg(2, 4, struct.pack('<IIII', 16, 0, 0, 0)),                      # GET_INFO
    msg(3, 5, struct.pack('<IIIIQQ', 256, 0, 2, 0, 0, 0)),             # REGION_INFO 2
    msg(4, 7, struct.pack('<IIII', 16, 0, 1, 0)),                      # IRQ_INFO 1
    msg(5, 2, struct.pack('<IIQQQ', 32, 3, 0, 0x800000, 0x4000)),      # fd-less DMA_MAP
    msg(6, 9, acc(7, 0, 4)),                                           # REGION_READ
    msg(7, 10, acc(0, 0x200, 8) + struct.pack('<Q', 0x800000)),        # DMA_IOVA
    msg(8, 10, acc(0, 0x208, 4) + struct.pack('<I', 16)),              # DMA_LEN
    msg(9, 10, acc(0, 0x20c, 4) + struct.pack('<I', 1)),               # DMA_OP read
    msg(10, 10, acc(0, 0x20c, 4) + struct.pack('<I', 2), flags=0x10),  # posted DMA_OP write
    msg(11, 8, struct.pack('<IIIII', 20, 0x1 | 0x20, 1, 0, 2)),        # SET_IRQS none
    msg(12, 15, struct.pack('<Q', 1) + acc(0, 0x100, 4) + b'\x01' + b'\0' * 7),  # WRITE_MULTI
    msg(13, 16, struct.pack('<II', 8, 0x40000 | 6)),                   # FEATURE probe
    msg(14, 3, struct.pack('<IIQQ', 24, 0, 0x800000, 0x4000)),         # DMA_UNMAP
    msg(15, 13, b''),                                                  # RESET
    msg(16, 1, b'\0' * 4),                                             # second VERSION
    msg(17, 16, struct.pack('<II', 16, 0x10000 | 1)),                  # MIGRATION GET
    msg(18, 16, struct.pack('<II', 16, 0x10000 | 2)),                  # MIG_DEVICE_STATE GET
    msg(19, 16, struct.pack('<IIIi', 16, 0x20000 | 2, 3, -1)),         # SET STOP_COPY
    msg(20, 17, struct.pack('<II', 8 + 64, 64)),                       # MIG_DATA_READ
    msg(21, 16, struct.pack('<IIIi', 16, 0x20000 | 2, 4, -1)),         # SET RESUMING
    msg(22, 18, struct.pack('<II', 8 + 4, 4) + b'\x01\x02\x03\x04'),   # MIG_DATA_WRITE
]
caps = b'{"capabilities":{"max_msg_fds":16,"twin_socket":{"supported":true},' \
       b'"write_multiple":true,"pgsizes":4096}}'
version = b'\0\0\0\0' + caps + b'\0'
for d in ('server_stream', 'protocol_decode', 'control_decode'):
    os.makedirs(os.path.join(HERE, d), exist_ok=True)


def put(target, name, data):
    with open(os.path.join(HERE, target, name), 'wb') as f:
        f.write(data)


# server_stream: byte 0 is the knob (bit 0 twin socket, bit 1 prepend VERSION).
put('server_stream', 'session', b'\x02' + b''.join(cmds))
put('server_stream', 'session_twin', b'\x03' + b''.join(cmds))
put('server_stream', 'version_only', b'\x00' + msg(1, 1, version))
# protocol_decode: 16-byte header, knob byte, payload.
put('protocol_decode', 'version', msg(1, 1, version)[:16] + b'\x01' + version)
for i, c in enumerate(cmds):
    put('server_stream', f'one_{i}', b'\x02' + c)
    put('protocol_decode', f'cmd_{i}', c[:16] + b'\x00' + c[16:])


# The migration stream (framework/src/migration/stream.rs): frames of
# postcard(kind, len, crc) + payload, crc = CRC-32 of the kind byte and the payload.
def varint(n):
    out = b''
    while True:
        b = n & 0x7f
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def frame(kind, payload):
    import zlib
    crc = zlib.crc32(bytes([kind]) + payload) & 0xffffffff
    return varint(kind) + varint(len(payload)) + varint(crc) + payload


fmt = b'umdev-migration-stream'
start = frame(0, varint(len(fmt)) + fmt + varint(1))
stream = start + frame(1, b'precopy chunk') + frame(2, b'state bytes') + frame(3, b'')
# protocol_decode: the payload doubles as a migration stream.
put('protocol_decode', 'mig_stream', msg(30, 18, b'')[:16] + b'\x00' + stream)

# control_decode: byte 0 is the reader's buffer size (0: 8 KiB); then a control request
# line (and its payload), or a response line.
put('control_decode', 'list', b'\x00{"version":2,"request":{"op":"list","defined":true}}\n')
put('control_decode', 'create', b'\x07{"version":2,"request":{"op":"create","type":"gpu-4m",'
    b'"uuid":null,"params":{"k":"v"},"auto":true}}\n')
put('control_decode', 'migrate_load', b'\x03{"version":2,"request":{"op":"migrate_load",'
    b'"uuid":"00000000-0000-4000-8000-0000000000b1","type":"gpu/gpu-4m","state_len":%d}}\n'
    % len(stream) + stream)
put('control_decode', 'old_version', b'\x00{"version":9,"request":{"op":"frobnicate"}}\n')
put('control_decode', 'saved_reply', b'\x01{"version":2,"ok":{"reply":"saved","instance":'
    b'{"uuid":"u","parent":"gpu","type":"gpu-4m","params":{},"socket":"/s","client_attached":'
    b'false,"defined":true,"autostart":false,"dma":{"maps":0,"pinned_pages":0,"locked_pages":0,'
    b'"leaked_pins_released":0}},"state_len":5,"handed_over":true}}\nstate')

# The GPU's PRE_COPY chunk and state (devices/src/gpu/migration/wire.rs) for the 64 KiB
# framebuffer the target decodes them for: 15 solid pages and one page of bytes.
def header(fmt, version):
    return varint(len(fmt)) + fmt + varint(version)


pages = b''.join(varint(i) + b'\x00' + varint(0x11223344) for i in range(15))
pages += varint(15) + b'\x01' + varint(4096) + bytes(range(256)) * 16
chunk = header(b'umdev-gpu-fb', 1) + varint(65536) + varint(0) + varint(16) + pages
put('protocol_decode', 'gpu_chunk', bytes(16) + b'\x00' + chunk)
regs = varint(65536) + bytes(4) + b'\x00' + bytes(4) + b'\x00' + bytes(8)
gpu_state = header(b'umdev-gpu', 1) + regs + varint(1024) + bytes(1024) + varint(0) + varint(16) + pages
put('protocol_decode', 'gpu_state', bytes(16) + b'\x00' + gpu_state)
