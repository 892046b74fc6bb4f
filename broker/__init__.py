"""The bus: topics, the wire codec, chunking and an asyncio MQTT client. Knows nothing of learning."""

from broker.client import BusClient, BusStats, Envelope, Will
from broker.codec import BFLOAT16, decode, encode
from broker.config import BusConfig
from broker.errors import BusError, CodecError, MessageTooLarge
from broker.message import Kind, Message
from broker.topics import Topics, check_id

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
