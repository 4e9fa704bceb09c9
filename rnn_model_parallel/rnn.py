"""The tutorial's `rnn.RNNModel`, word_language_model's RNN split across RPC, and its parts."""

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.rpc import RRef


# Runs on the owner of rref: the method, called on the object that rref holds.
def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


# Calls the method on the object that rref holds, on its owner, and returns the result.
def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


# An RRef to each parameter of a local module, for DistributedOptimizer.
def _parameter_rrefs(module):
    param_rrefs = []
    for param in module.parameters():
        param_rrefs.append(RRef(param))
    return param_rrefs


def choose_embedding_device(gpu_count):
    """cuda:0 if the machine has a GPU, as in the tutorial, else the CPU (tests fake the count)."""
    return torch.device("cuda:0" if gpu_count > 0 else "cpu")


class EmbeddingTable(nn.Module):
    """The encoder of RNNModel: an embedding table, on a GPU if there is one."""
    def __init__(self, ntoken, ninp, dropout):
        super().__init__()
        self.device = choose_embedding_device(torch.cuda.device_count())
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp).to(self.device)
        self.encoder.weight.data.uniform_(-0.1, 0.1)

    def forward(self, input):
        # RPC hands over CPU tensors: indices in from the CPU, embeddings back to it.
        return self.drop(self.encoder(input.to(self.device))).cpu()

    def get_device(self):
        return str(self.device)


class Decoder(nn.Module):
    def __init__(self, ntoken, nhid, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.bias.data.zero_()
        self.decoder.weight.data.uniform_(-0.1, 0.1)

    def forward(self, output):
        return self.decoder(self.drop(output))


class RNNModel(nn.Module):
    """The embedding table and the decoder on the parameter server `ps`, the LSTM here."""
    def __init__(self, ps, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super().__init__()
        # the embedding table, on ps
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout))
        # Wait for the table to exist (by asking where it is) before creating the decoder, so
        # that ps draws their random weights in the same order in every run.
        self.table_device = _remote_method(EmbeddingTable.get_device, self.emb_table_rref)
        # the LSTM, here
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        # the decoder, on ps
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid, dropout))

    def forward(self, input, hidden):
        # the embeddings of the input, from the table on ps
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, input)
        output, hidden = self.rnn(emb, hidden)
        # the scores of the next token, from the decoder on ps
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self):
        remote_params = []
        # the table's, from ps
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_table_rref))
        # the LSTM's, here
        remote_params.extend(_parameter_rrefs(self.rnn))
        # the decoder's, from ps
        remote_params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return remote_params
