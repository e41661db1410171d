from train.corpus import VALID_BOOKS, code_documents, detokenise, prose_documents, split


def test_detokenise_undoes_word_tokenisation():
    assert detokenise("Emma Woodhouse , handsome , clever , and rich .") == "Emma Woodhouse, handsome, clever, and rich."
    assert detokenise("`` I can not agree with you , papa ; you know I can not . ''") == \
        '"I can not agree with you, papa; you know I can not."'
    assert detokenise("Do n't you , ma'am ? It 's her sister 's ( she said ) .") == \
        "Don't you, ma'am? It's her sister's (she said)."
    assert detokenise("` Well , Hetty ' -- do n't you") == "'Well, Hetty' -- don't you"


def test_validation_holds_out_whole_documents():
    prose = prose_documents()
    train, valid = split(prose, lambda i, k: k in VALID_BOOKS)
    assert set(valid) == set(VALID_BOOKS) and not set(train) & set(valid)
    code = code_documents()
    assert code and not any("site-packages" in k or "/test/" in f"/{k}" for k in code)
