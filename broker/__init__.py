"""The bus: topics, the wire codec, chunking and an asyncio MQTT client. Knows nothing of learning."""

from fedmq.broker.client import BusClient, BusStats, Envelope, Will
from fedmq.broker.codec import BFLOAT16, decode, encode
from fedmq.broker.config import BusConfig
from fedmq.broker.errors import BusError, CodecError, MessageTooLarge
from fedmq.broker.message import Kind, Message
from fedmq.broker.topics import Topics, check_id

__all__ = [
    "BFLOAT16",
    "BusClient",
    "BusConfig",
    "BusError",
    "BusStats",
    "CodecError",
    "Envelope",
    "Kind",
    "Message",
    "MessageTooLarge",
    "Topics",
    "Will",
    "check_id",
    "decode",
    "encode",
]
