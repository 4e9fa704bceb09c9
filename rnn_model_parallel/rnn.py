"""The tutorial's `rnn.RNNModel`, word_language_model's RNN split across RPC: the embedding
table and the decoder on a parameter server, the LSTM on the trainer. Each line that is not the
tutorial's ends with "# ours:" and why, or sits under a comment that says so."""

# ours: the imports and the order of the pytorch/examples script's rnn.py (the tutorial shows
# no imports, and its _parameter_rrefs after RNNModel)
import torch
import torch.nn as nn
import torch.distributed.rpc as rpc
from torch.distributed.rpc import RRef


# Runs on the owner of rref: the method, called on the object that rref holds.
def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


# Calls the method on the object that rref holds, on its owner, and returns the result.
# ours: the script's form of the tutorial's _remote_method (its first part): the same call
def _remote_method(method, rref, *args, **kwargs):
    return rpc.rpc_sync(
        rref.owner(),
        _call_method,
        args=[method, rref] + list(args),
        kwargs=kwargs
    )


# An RRef to each parameter of a local module, for DistributedOptimizer.
def _parameter_rrefs(module):
    param_rrefs = []
    for param in module.parameters():
        param_rrefs.append(RRef(param))
    return param_rrefs


# ours: the table's device, in one place, which the tests call with faked GPU counts
def choose_embedding_device(gpu_count):
    return torch.device("cuda:0" if gpu_count > 0 else "cpu")


class EmbeddingTable(nn.Module):
    # the encoder of RNNModel: an embedding table, on a GPU if there is one
    def __init__(self, ntoken, ninp, dropout):
        super(EmbeddingTable, self).__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)  # ours: the script's, with no .cuda() (below)
        # ours: the table on cuda:0 where the machine has a GPU, else on the CPU
        self.device = choose_embedding_device(torch.cuda.device_count())
        self.encoder = self.encoder.to(self.device)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)  # ours: the script's, for .data.uniform_

    def forward(self, input):
        input = input.to(self.device)  # ours: to the table's device (above)
        return self.drop(self.encoder(input)).cpu()  # ours: the parenthesis the tutorial misses

    # ours: where the table is, which the trainer says
    def get_device(self):
        return str(self.device)


class Decoder(nn.Module):
    # the decoder of RNNModel
    def __init__(self, ntoken, nhid, dropout):
        super(Decoder, self).__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.zeros_(self.decoder.bias)  # ours: the script's, for the tutorial's .data.zero_()
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)  # ours: and .data.uniform_(-0.1, 0.1)

    def forward(self, output):
        return self.decoder(self.drop(output))


class RNNModel(nn.Module):
    # The embedding table and the decoder on the parameter server `ps`, the LSTM here: the
    # model of pytorch/examples' word_language_model, split across RPC.
    def __init__(self, ps, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super(RNNModel, self).__init__()

        # the embedding table, on ps
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout))
        # ours: the table made before the decoder, so that ps draws their weights in one order
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
